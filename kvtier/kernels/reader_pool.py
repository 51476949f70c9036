"""The file tier's native reader threads (``fileread.c``'s pool), reporting to the event loop.

Why not Python threads: a Python thread that comes back from a native read must take the GIL again
before it can report, and while the event loop's thread runs Python (planning the next batches) it
keeps the GIL for up to the switch interval (5 ms): reads that took a millisecond then wait for
several. The pool's threads never touch Python: each queued batch is one ``kvt_read_warm`` call, and
its token goes down a pipe that the submitting event loop watches (``add_reader``), so the loop takes
each completion in its own turn. docs/architecture.md#kernels.

One pool per file tier, bound to one event loop at a time (the cache's loop thread); a call from
another loop while the bound one lives gets None and reads the way it would without the helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading

import numpy as np

from kvtier.kernels import host


class ReaderPool:
    """``threads`` native readers, started on first use in each process (a forked child starts its own)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a reader pool needs at least one thread, got {threads}")
        self._threads = threads
        self._handle: int | None = None
        self._pid = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_fd = self._write_fd = -1
        self._partial = b""  # (a token is 8 bytes; a read never splits one, but be sure)
        #: token -> (future, the batch's statuses, what its C call points at: alive until the token is back)
        self._pending: dict[int, tuple[asyncio.Future[np.ndarray], np.ndarray, tuple[object, ...]]] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()  # orders submits with stop (the pool's memory is freed by stop)
        self._closed = False

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, prefix: bytes, hashes: bytes, hash_len: int, suffix: bytes, outs: np.ndarray, size: int,
               chunk: int, expected: bytes, header_size: int, checksum_offset: int, page_size: int,
               ) -> asyncio.Future[np.ndarray] | None:
        """Queue :func:`host.read_warm`'s batch; its future (of the blocks' statuses) is done on this loop.

        None (nothing queued) where the pool cannot serve this loop: helper unavailable, closed, bound
        to another live loop, or an event loop without ``add_reader``. The caller keeps ``outs``'s
        buffers alive and untouched until the future is done, even if it stops waiting for it.
        """
        loop = asyncio.get_running_loop()
        if not self._bind(loop):
            return None
        n = host.check_batch(hashes, hash_len, outs, expected, header_size, chunk)
        status = np.empty(n, dtype=np.int32)
        future: asyncio.Future[np.ndarray] = loop.create_future()
        token = next(self._tokens)
        self._pending[token] = (future, status, (prefix, hashes, suffix, outs, expected))
        with self._lock:
            queued = self._handle is not None and host._lib.kvt_pool_submit(  # type: ignore[union-attr]
                self._handle, n, prefix, hashes, hash_len, suffix, outs.ctypes.data, size, chunk, expected,
                header_size, checksum_offset, page_size, status.ctypes.data, host._xxh3, token) == 0
        if not queued:
            del self._pending[token]
            return None
        return future

    def _bind(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Have threads in this process and ``loop`` watching their pipe; False where that cannot be."""
        if self._closed:
            return False
        if self._pid != os.getpid():
            self._forget_parent()
        if self._loop is loop:
            return True
        if self._loop is not None and not self._loop.is_closed():
            return False
        if self._handle is None and not self._start():
            return False
        try:
            loop.add_reader(self._read_fd, self._collect)
        except NotImplementedError:  # an event loop without readers (Windows' proactor)
            return False
        self._loop = loop
        return True

    def _start(self) -> bool:
        lib = host._lib if host._tried else host._load()
        if lib is None or host._xxh3 is None:
            self._closed = True
            return False
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(read_fd, False)
        handle = lib.kvt_pool_start(self._threads, write_fd)
        if not handle:
            os.close(read_fd)
            os.close(write_fd)
            self._closed = True
            return False
        self._handle, self._read_fd, self._write_fd = handle, read_fd, write_fd
        return True

    def _forget_parent(self) -> None:
        """In a forked child (or on first use): the parent's threads are not here; its pool is left
        unfreed (its C lock may be held), its pipe closed, its batches forgotten, and the submit lock is
        a new one (a parent's thread may have held it at the fork)."""
        if self._pid:
            for fd in (self._read_fd, self._write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._handle, self._loop, self._read_fd, self._write_fd = None, None, -1, -1
        self._pending.clear()
        self._partial = b""
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _collect(self) -> None:
        """The pipe is readable: finish the futures of the batches whose tokens came back."""
        try:
            data = self._partial + os.read(self._read_fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        whole = len(data) - len(data) % 8
        self._partial = data[whole:]
        for token in memoryview(data[:whole]).cast("Q").tolist():
            entry = self._pending.pop(token, None)
            if entry is not None:
                _finish(entry[0], entry[1])

    def stop(self) -> None:
        """Let the threads finish every queued batch, then join them (blocks; any thread)."""
        with self._lock:
            handle, self._handle = self._handle, None
            self._closed = True
        if handle is not None and self._pid == os.getpid():
            host._lib.kvt_pool_stop(handle)  # type: ignore[union-attr]

    def close(self) -> None:
        """:meth:`stop`, then (on the bound loop's thread) finish what came back and close the pipe."""
        self.stop()
        if self._read_fd < 0 or self._pid != os.getpid():
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            if loop.is_running() and asyncio._get_running_loop() is not loop:
                return  # another thread's loop still watches the pipe: leave it open
            loop.remove_reader(self._read_fd)
        before = -1
        while len(self._pending) != before:  # every batch is done: its token is in the pipe
            before = len(self._pending)
            self._collect()
        for future, status, _ in self._pending.values():
            _finish(future, status)
        self._pending.clear()
        os.close(self._read_fd)
        os.close(self._write_fd)
        self._read_fd = self._write_fd = -1
        self._loop = None


def _finish(future: asyncio.Future[np.ndarray], status: np.ndarray) -> None:
    if not future.done():
        with contextlib.suppress(RuntimeError):  # its loop was closed meanwhile
            future.set_result(status)
