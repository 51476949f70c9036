"""Typed errors: each carries what a user needs to fix the problem (key path, shape, dtype)."""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class KVTierConfigError(KVTierError, ValueError):
    """A configuration is invalid; the message starts with the key path of the bad value."""

    def __init__(self, path: str, message: str, *, problems: tuple[str, ...] = ()) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)
        #: every problem found, one line each (``kvtier check`` prints them all); the message names the first
        self.problems = problems or (str(self),)


class LayoutMismatch(KVTierError, ValueError):
    """A tensor or a stored block does not have the layout (shape, dtype, strides) kvtier expects."""


class TierUnavailable(KVTierError, RuntimeError):
    """A tier cannot serve right now (server down, circuit open, CUDA missing)."""


class CorruptBlock(KVTierError):
    """A stored block failed validation (checksum, header, key or layout); it is treated as a miss."""


class CacheClosed(KVTierError, RuntimeError):
    """The cache was closed: every later call raises this, and so does a call that close() cut short."""


class CacheForked(CacheClosed):
    """The cache was made in another process, and this one is its forked child: the cache's loop and
    I/O threads did not survive the fork, so every call here raises this (make a new cache in the child)."""


class CalledOnLoopThread(KVTierError, RuntimeError):
    """A blocking call of :class:`~kvtier.TieredCache` ran on the cache's own loop thread (in a done-callback
    of a ``submit_load``/``submit_store`` future, say), where it would wait on itself forever."""
