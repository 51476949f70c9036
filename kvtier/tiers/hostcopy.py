"""Copies between a memory tier's slab and a caller's host buffers, split over a few threads when large.

One thread's ``memcpy`` does not reach a host's memory bandwidth: on the 2-CPU CI machine one thread
copies 256 KiB rows at ~9 GB/s and two threads at 11-12 GB/s (``benchmarks/bench_cache_cpu.py``
measures both). numpy releases the GIL while it copies, so the parts of a batch run at once: the
caller's thread copies one part, the copier's threads the others, and the call returns when every
part is done. Batches under ``min_bytes`` are copied on the caller's thread alone (a hand-off costs
tens of microseconds).

Whether a split pays depends on the host: on another 2-CPU VM one thread already copied at 20 GB/s
and two threads loaded 256 KiB rows 10-20 % slower than one, while costing more CPU either way. So
with ``adaptive`` (a tier's ``copy_threads: auto``) the copier times its own copies and splits a
kind of copy only while splitting measures faster (:class:`SplitChoice`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import numpy as np
import torch

from kvtier.hostinfo import usable_cpus
from kvtier.kernels import host
from kvtier.tiers.buffers import as_rows, strided_rows

#: batches smaller than this are copied on the caller's thread alone
MIN_SPLIT_BYTES = 1 << 20
#: column splits of a short batch are cut at multiples of this (whole cache lines and pages)
_CUT = 4096


class SplitChoice:
    """Whether to split one kind of copy over the threads, learned from the copies' own speed.

    Two running averages of bytes per second, one per way: the first copies alternate between one
    thread and a split until each way has :data:`WARMUP` measurements (one copy is too noisy to decide
    on); from then on the faster way runs, but a split must be :data:`MIN_GAIN` faster to be chosen
    (it spends more CPU per byte), and one copy in :data:`EXPLORE_EVERY` runs the other way so that a
    change of load is seen. Not thread-safe: a race only costs a copy run the other way.
    """

    #: a split is chosen only where it measures this much faster than one thread
    MIN_GAIN = 1.1
    #: measurements of each way before the faster one is chosen
    WARMUP = 4
    #: once both ways are measured, one copy in this many runs the way not chosen
    EXPLORE_EVERY = 16
    #: weight of the newest measurement in a running average
    WEIGHT = 0.25

    __slots__ = ("rates", "counts", "calls")

    def __init__(self) -> None:
        #: bytes per second: [one thread, split]; 0 until measured
        self.rates = [0.0, 0.0]
        self.counts = [0, 0]
        self.calls = 0

    def split(self) -> bool:
        """Whether the next copy of this kind should be split."""
        ones, splits = self.counts
        if splits < self.WARMUP:
            return ones > splits  # one thread first, then turn about
        self.calls += 1
        better = self.rates[1] >= self.rates[0] * self.MIN_GAIN
        return not better if self.calls % self.EXPLORE_EVERY == 0 else better

    def record(self, split: bool, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-9)
        count = self.counts[split] = self.counts[split] + 1
        # a plain mean over the warm-up, then a running average
        weight = 1.0 / count if count <= self.WARMUP else self.WEIGHT
        self.rates[split] += weight * (rate - self.rates[split])


def default_copy_threads() -> int:
    """Threads a CPU tier copies a large batch with when the config does not say: two, or one where
    the process may run on one CPU only (measured: a third thread on two CPUs gains nothing)."""
    return min(2, usable_cpus())


class RowCopier:
    """Copies rows between ``[n, nbytes]`` arrays and slab rows, on up to ``threads`` threads (the
    caller's and ``threads - 1`` of its own, started on first use, named ``<name>-<i>``).

    ``streaming``: copies into the slab use streaming stores (:mod:`kvtier.kernels.host`) where the
    helper is available; copies out of it always go through the caches, as the caller reads them next.
    ``adaptive``: split a kind of copy (into or out of the slab, rows under or over 1 MiB) only while
    splitting measures faster (:class:`SplitChoice`); else every copy of ``min_bytes`` or more splits.
    ``clock``: the timer of those measurements (tests pass their own).
    """

    def __init__(self, threads: int = 1, *, name: str = "kvtier-copy", min_bytes: int = MIN_SPLIT_BYTES,
                 streaming: bool = False, adaptive: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if threads < 1:
            raise ValueError(f"copy threads must be at least 1, got {threads}")
        self.threads = threads
        self.adaptive = adaptive
        #: per kind of copy, (into_slab, rows of 1 MiB or more): what splitting it measured
        self.choices = {(into, large): SplitChoice() for into in (False, True) for large in (False, True)}
        self._clock = clock
        #: whether copies into the slab stream (False where asked for but the helper is unavailable)
        self.streaming = streaming and host.available()
        self.min_bytes = min_bytes
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the copier's threads (copies in flight finish); later copies run on the caller's thread."""
        with self._lock:
            pool, self._pool, self.threads = self._pool, None, 1
        if pool is not None:
            pool.shutdown(wait=True)

    # --- the two shapes a batch comes in ---------------------------------------------------------------
    def batch(self, rows_np: np.ndarray, slab_np: np.ndarray, slots: list[int], *, into_slab: bool) -> None:
        """Copy between ``[n, nbytes]`` ``rows_np`` and the slab rows ``slots`` (row i ↔ ``slots[i]``)."""
        n = len(slots)
        choice, parts = self._parts(n, rows_np.nbytes, into_slab, slab_np.shape[1])
        stream = into_slab and self.streaming
        start = self._clock() if choice is not None else 0.0
        if parts == 1:
            _copy_batch(rows_np, slab_np, slots, into_slab=into_slab, stream=stream)
        elif n >= parts:  # whole rows per part
            cuts = [n * p // parts for p in range(parts + 1)]
            self._run([partial(_copy_batch, rows_np[a:z], slab_np, slots[a:z], into_slab=into_slab,
                               stream=stream)
                       for a, z in zip(cuts, cuts[1:], strict=False)])
        else:  # fewer rows than threads: every part copies a band of columns of every row
            cols = _column_cuts(rows_np.shape[1], parts)
            self._run([partial(_copy_batch, rows_np[:, a:z], slab_np[:, a:z], slots, into_slab=into_slab,
                               stream=stream)
                       for a, z in zip(cols, cols[1:], strict=False)])
        if choice is not None:
            choice.record(parts > 1, rows_np.nbytes, self._clock() - start)

    def rows(self, buffers: Sequence[torch.Tensor], slab: torch.Tensor, slots: list[int], *,
             into_slab: bool) -> None:
        """Copy between 1-D uint8 ``buffers`` (one per slot) and slab rows ``slots``.

        When the buffers are consecutive rows of one tensor (what the cache passes) the batch is
        :meth:`batch`. Otherwise: device buffers (GPU tier demotions) by torch, one copy each; host
        buffers by numpy, one copy each, split over the threads when large.
        """
        if not buffers:
            return
        batch = as_rows(buffers) if len(buffers) > 1 else None
        if batch is not None and batch.device.type == "cpu":
            self.batch(batch.numpy(), slab.numpy(), slots, into_slab=into_slab)
            return
        if any(buf.device.type != "cpu" for buf in buffers):
            for buf, slot in zip(buffers, slots, strict=True):
                if into_slab:
                    slab[slot].copy_(buf)
                else:
                    buf.copy_(slab[slot])
            return
        slab_np = slab.numpy()
        pairs = [(slab_np[slot], buf.numpy()) if into_slab else (buf.numpy(), slab_np[slot])
                 for buf, slot in zip(buffers, slots, strict=True)]
        n = len(pairs)
        nbytes = sum(buf.numel() for buf in buffers)
        choice, parts = self._parts(n, nbytes, into_slab, slab_np.shape[1])
        stream = into_slab and self.streaming
        start = self._clock() if choice is not None else 0.0
        if parts == 1 or n < parts:
            parts = 1
            _copy_pairs(pairs, stream)
        else:
            cuts = [n * p // parts for p in range(parts + 1)]
            self._run([partial(_copy_pairs, pairs[a:z], stream)
                       for a, z in zip(cuts, cuts[1:], strict=False)])
        if choice is not None:
            choice.record(parts > 1, nbytes, self._clock() - start)

    # --- running the parts -----------------------------------------------------------------------------
    def _parts(self, rows: int, nbytes: int, into_slab: bool, row_bytes: int,
               ) -> tuple[SplitChoice | None, int]:
        """How many parts a copy runs in, and the choice that measures it (None: not measured)."""
        if self.threads == 1 or rows == 0 or nbytes < self.min_bytes:
            return None, 1
        if not self.adaptive:
            return None, self.threads
        choice = self.choices[into_slab, row_bytes >= MIN_SPLIT_BYTES]
        return choice, self.threads if choice.split() else 1

    def _run(self, parts: list[Callable[[], None]]) -> None:
        """Run ``parts[1:]`` on the copier's threads and ``parts[0]`` here; return when all are done (a
        caller's buffer is never written after the call returns), raising the first failure."""
        with self._lock:
            pool = self._pool
            if pool is None and self.threads > 1:
                pool = self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
        if pool is None:  # closed meanwhile
            for part in parts:
                part()
            return
        try:
            futures: list[Future[None]] = [pool.submit(part) for part in parts[1:]]
        except RuntimeError:  # shut down by close() between the lock and here
            for part in parts:
                part()
            return
        try:
            parts[0]()
        finally:
            wait(futures)
        for future in futures:
            future.result()


def _column_cuts(nbytes: int, parts: int) -> list[int]:
    """``parts + 1`` column offsets splitting ``nbytes`` into near-equal bands cut at :data:`_CUT`."""
    cuts = [min(nbytes, (nbytes * p // parts) // _CUT * _CUT) for p in range(parts)] + [nbytes]
    return sorted(set(cuts))


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], stream: bool = False) -> None:
    for dst, src in pairs:
        if not (stream and host.stream_copy(dst[None], src[None])):
            np.copyto(dst, src)


def _copy_batch(rows_np: np.ndarray, slab_np: np.ndarray, slots: list[int], *, into_slab: bool,
                stream: bool = False) -> None:
    """Copy between ``[n, nbytes]`` rows and the slab rows ``slots`` on this thread: one call when the
    slots step evenly; into the slab otherwise one fancy-indexed assignment; out of it one
    ``np.copyto`` per block (measured: ``np.take(..., out=)`` runs at a third of the speed of row
    copies, and ``torch`` row copies split 2 MiB across threads for no gain). ``stream``: copies into
    the slab with streaming stores where the helper takes them (one call either way)."""
    if not slots:
        return
    run = strided_rows(slab_np, slots)
    if run is not None:
        if into_slab:
            if not (stream and host.stream_copy(run, rows_np)):
                np.copyto(run, rows_np)
        else:
            np.copyto(rows_np, run)
    elif into_slab:
        if not (stream and host.stream_scatter(slab_np, slots, rows_np)):
            slab_np[np.asarray(slots)] = rows_np
    else:
        for row, slot in zip(rows_np, slots, strict=True):
            np.copyto(row, slab_np[slot])


#: copies on the caller's thread only (tiers built without a copier, external fills)
SERIAL = RowCopier(1)
