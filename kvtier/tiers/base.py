"""The one interface every storage tier implements: batched operations on whole blocks.

A tier knows bytes, never decisions: it stores, returns and deletes whole blocks (1-D ``uint8``
tensors of the group's block bytes) and reports what it holds; :mod:`kvtier.policy` decides and
:class:`kvtier.cache.TieredCache` wires. ``put`` and ``get`` never raise for I/O faults, dead servers
or corrupt blocks (docs/architecture.md#failure-contract), only for programming errors.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvtier.blocks import BlockKey, all_of_group
from kvtier.errors import LayoutMismatch
from kvtier.layout import BlockLayout

log = logging.getLogger("kvtier.tiers")


@dataclass
class TierCounters:
    """Raw counters a tier keeps about its own I/O; the cache adds hits/misses on top.

    The tier is the only writer of these (the cache times its calls for the latency histograms
    only), so ``bytes / seconds`` is the tier's real throughput; the one exception is
    :meth:`kvtier.cache.AsyncTieredCache.read_leased`, whose memory copies bypass the tier.
    A memory tier is written from two threads (the loop's calls, and a cache's copies on the caller's
    thread, docs/architecture.md "Calls on the caller's thread"): update through :meth:`add_writes`,
    :meth:`add_reads` and :meth:`error`, whose lock keeps a ``+=`` of one thread from losing the other's.
    """

    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + count

    def add_writes(self, blocks: int, nbytes: int, seconds: float = 0.0) -> None:
        """``blocks`` written (``nbytes`` of them) in ``seconds``."""
        with self._lock:
            self.blocks_written += blocks
            self.bytes_written += nbytes
            self.write_seconds += seconds

    def add_reads(self, blocks: int, nbytes: int, seconds: float = 0.0) -> None:
        """``blocks`` read (``nbytes`` of them) in ``seconds``."""
        with self._lock:
            self.blocks_read += blocks
            self.bytes_read += nbytes
            self.read_seconds += seconds


class Tier(ABC):
    """A place where whole KV blocks live.

    ``layouts`` maps group id → the layout of that group's blocks; ``capacity_bytes`` maps group id →
    the bytes this tier may hold for that group (the cache never asks for more: it evicts first).
    """

    #: Short type name used in config (``cpu``, ``file``, ``redis`` …).
    kind: ClassVar[str]
    #: True when the backing store evicts on its own (Redis ``maxmemory``): kvtier keeps no index of
    #: such a tier and asks it with :meth:`contains` instead.
    self_evicting: ClassVar[bool] = False
    #: True when :meth:`views` can hand out zero-copy tensors of resident blocks.
    addressable: ClassVar[bool] = False

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout],
                 capacity_bytes: Mapping[int, int]) -> None:
        self.name = name
        self.layouts = dict(layouts)
        self.capacity_bytes = dict(capacity_bytes)
        #: bumped when the tier changes ``capacity_bytes`` itself (a full disk): the cache then follows
        self.capacity_version = 0
        self.counters = TierCounters()
        #: ``"ok"``, or why the tier is degraded now (``"enospc"``, ``"circuit open: host:port"`` …)
        self.health = "ok"
        _LIVE_TIERS.add(self)

    # --- data path -------------------------------------------------------------------------------
    @abstractmethod
    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; an existing block is overwritten.

        Called by the cache after it made room. Returns per-block success; a ``False`` block is
        not stored (its old value, if any, is gone too). Never raises for I/O faults.
        """

    @abstractmethod
    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> list[bool]:
        """Copy the block of ``keys[i]`` into ``out[i]`` (caller memory, block bytes long).

        ``False`` means a miss: absent, unreadable or failing validation — and a block that failed
        validation is deleted. ``out[i]`` of a miss holds unspecified bytes.
        """

    @abstractmethod
    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored (a cheap check; ``get`` may still miss on a corrupt block)."""

    @abstractmethod
    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove the keys; absent keys are ignored; failures are counted, never raised."""

    @abstractmethod
    def keys(self) -> Iterator[BlockKey]:
        """Every key the tier holds now (used to rebuild the cache index at start)."""

    @abstractmethod
    def usage_bytes(self) -> int:
        """Bytes of blocks held, counted at their raw (uncompressed) block size."""

    def views(self, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        """Zero-copy views of resident blocks (only for :attr:`addressable` tiers)."""
        raise NotImplementedError(f"tier {self.name!r} ({self.kind}) has no addressable memory")

    async def close(self) -> None:  # noqa: B027 - optional hook, memory tiers hold nothing to release
        """Release resources; further calls are undefined."""

    def after_fork_in_child(self) -> None:
        """Called in a forked child, before anything else runs there: drop what the parent's threads
        owned (I/O threads, which are not in the child, locks they may have held, connections they share
        with the parent), so the tier works in the child as a fresh one over the same data. A tier
        with threads or connections extends this."""
        self.counters._lock = threading.Lock()

    def chain_links(self) -> dict[BlockKey, BlockKey]:
        """Predecessor of each held block whose link was recorded (persistent tiers; others: none)."""
        return {}

    def record_links(self, links: Sequence[tuple[BlockKey, BlockKey]]) -> None:  # noqa: B027 - optional
        """Remember (key, predecessor) links of stored blocks across restarts (persistent tiers only)."""

    def report_health(self, ok: bool, reason: str = "") -> None:
        """Record the tier's state; logs one line per change (degraded ↔ ok), never one per block."""
        state = "ok" if ok else (reason or "degraded")
        if state == self.health:
            return
        previous, self.health = self.health, state
        if ok:
            log.warning("tier %r (%s) recovered (was: %s)", self.name, self.kind, previous)
        else:
            log.warning("tier %r (%s) degraded: %s; its blocks are misses or failed stores until it recovers",
                        self.name, self.kind, state)

    # --- helpers for implementations ----------------------------------------------------------------
    def block_bytes(self, group_id: int) -> int:
        try:
            return self.layouts[group_id].nbytes
        except KeyError:
            raise LayoutMismatch(f"tier {self.name!r} has no KV-cache group {group_id} "
                                 f"(groups: {sorted(self.layouts)})") from None

    def _is_row_batch(self, keys: Sequence[BlockKey], rows: torch.Tensor) -> bool:
        """Whether ``rows`` is a contiguous ``[len(keys), nbytes]`` uint8 CPU tensor of one group's blocks
        (the shape the cache passes for a run of its caller's rows)."""
        if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != len(keys) or not keys
                or rows.device.type != "cpu" or not rows.is_contiguous()):
            return False
        group_id = keys[0].group_id
        layout = self.layouts.get(group_id)
        return layout is not None and rows.shape[1] == layout.nbytes and all_of_group(keys, group_id)

    def check_buffers(self, keys: Sequence[BlockKey], buffers: Sequence[torch.Tensor], what: str) -> None:
        """Raise :class:`LayoutMismatch` unless each buffer is a contiguous uint8 block of its group."""
        if len(keys) != len(buffers):
            raise LayoutMismatch(f"{len(keys)} keys but {len(buffers)} {what} buffers")
        sizes: dict[int, int] = {}
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            expected = sizes.get(key.group_id)
            if expected is None:
                expected = sizes[key.group_id] = self.block_bytes(key.group_id)
            if (buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != expected
                    or not buf.is_contiguous()):
                raise LayoutMismatch(
                    f"{what}[{i}] must be a contiguous 1-D uint8 tensor of {expected} bytes for group "
                    f"{key.group_id}, got dtype {buf.dtype}, shape {tuple(buf.shape)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity={sum(self.capacity_bytes.values())})"


# --- a forked child: the tiers it inherited start afresh there ----------------------------------------
#: every tier made in this process (weakly): a forked child lets each drop its parent's threads
_LIVE_TIERS: weakref.WeakSet[Tier] = weakref.WeakSet()


def _after_fork() -> None:
    for tier in list(_LIVE_TIERS):
        try:
            tier.after_fork_in_child()
        except Exception:  # a child must start whatever one tier does
            log.exception("tier %r could not reset itself in a forked child", tier.name)


os.register_at_fork(after_in_child=_after_fork)
