"""The worker side: vLLM's ``OffloadingWorker`` transfer calls over an :class:`OffloadRuntime`.

Independent of vLLM's classes (``kvtier.connectors.vllm.spec`` subclasses it as vLLM's worker).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from kvtier.blocks import BlockKey
from kvtier.connectors.vllm.manager import BlockTransferSpec
from kvtier.connectors.vllm.runtime import OffloadRuntime
from kvtier.errors import LayoutMismatch
from kvtier.pages import CudaPageMover, PageMover

log = logging.getLogger(__name__)


@dataclass
class _Job:
    future: concurrent.futures.Future[Any]
    is_load: bool
    nbytes: int
    started: float
    scatters: list[tuple[PageMover, torch.Tensor, np.ndarray, int]] = field(default_factory=list)
    # CUDA: the event after this load's page copies (already enqueued); done once it completed.
    copied: Any = None
    # CUDA loads straight out of a CPU tier's slots: the leases the kernels read under, released once
    # ``copied`` completed.
    leases: tuple[list[BlockKey], list[int]] | None = None


def split_by_group(keys: Sequence[BlockKey], block_ids: Any, group_sizes: Sequence[int],
                   num_groups: int) -> list[tuple[list[BlockKey], np.ndarray]]:
    """Per kvtier group: its keys (in order) and its engine block ids (vLLM sends both group-major)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if num_groups == 1 and len(group_sizes) <= 1:  # one group (the usual case): no key to sort
        if group_sizes and group_sizes[0] != len(ids):
            raise LayoutMismatch(f"transfer names {len(ids)} engine blocks in groups of {list(group_sizes)}")
        return [(keys if isinstance(keys, list) else list(keys), ids)]
    sizes = list(group_sizes) if group_sizes else [len(ids)]
    if len(sizes) != num_groups or sum(sizes) != len(ids):
        raise LayoutMismatch(f"transfer names {len(ids)} engine blocks in groups of {sizes}; the engine has "
                             f"{num_groups} offloaded groups")
    keys_by_group: list[list[BlockKey]] = [[] for _ in range(num_groups)]
    for key in keys:
        keys_by_group[key.group_id].append(key)
    out, start = [], 0
    for g, size in enumerate(sizes):
        out.append((keys_by_group[g], ids[start:start + size]))
        start += size
    return out


def _reads(keys: list[BlockKey], sources: list[int], buffers: list[tuple[list[BlockKey], torch.Tensor]]
           ) -> tuple[list[BlockKey], list[int], Sequence[torch.Tensor], list[int]]:
    """A load's reads (keys, sources, where each block goes) and the indexes of the keys none of them takes.

    ``buffers``: per group, its keys in load order and its ``[n, nbytes]`` buffer. When one buffer takes
    every key (one group, the usual case) it goes whole, and the runtime types it with one view, not one
    per block; otherwise one row per block.
    """
    if len(buffers) == 1 and len(buffers[0][0]) == len(keys):  # split_by_group keeps the keys' order
        return keys, sources, cast("Sequence[torch.Tensor]", buffers[0][1]), []  # its rows are the blocks
    order = {key: i for i, key in enumerate(keys)}
    outs: list[torch.Tensor | None] = [None] * len(keys)
    for group_keys, raw in buffers:
        for row, key in enumerate(group_keys):
            outs[order[key]] = raw[row]
    reads = [i for i, out in enumerate(outs) if out is not None]
    unread = [i for i, out in enumerate(outs) if out is None]  # a group the engine needs no blocks of
    return ([keys[i] for i in reads], [sources[i] for i in reads],
            [cast("torch.Tensor", outs[i]) for i in reads], unread)


class KVTierOffloadWorkerCore:
    """vLLM's worker-side transfer calls over an :class:`OffloadRuntime` (independent of vLLM's classes).

    ``submit_store`` copies the pages out at once (the engine may reuse its blocks as soon as the job
    is acknowledged) and stores them: at once on this thread into CPU tiers — host pages straight into
    the tier's slots (``OffloadRuntime.store_with``), with no buffer between — else in the background
    on kvtier's loop (``OffloadRuntime.store``); ``submit_load`` copies the leased blocks at once
    (they are in memory: a memory tier or staging). Host pages of one group that one CPU tier holds are
    written at once, straight from the tier's slots (``OffloadRuntime.read_with``; on CUDA the kernels
    read the page-locked slots, which stay leased until the copy completed); otherwise the blocks go
    through a buffer and the pages are written by ``get_finished`` on the engine's thread (by the
    kernels at once on CUDA), before the job is reported done.
    A store a tier refused is reported done (it is a later miss); a load reports failure only if a
    leased block could not be read, which pins make impossible short of a bug.
    """

    result_type: Callable[..., Any] = staticmethod(lambda **kw: kw)

    def __init__(self, runtime: OffloadRuntime, movers: Sequence[PageMover], blocks_per_chunk: int,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self.runtime = runtime
        self.movers = list(movers)
        self.blocks_per_chunk = blocks_per_chunk
        self._jobs: dict[int, _Job] = {}
        self._on_shutdown = on_shutdown
        self._said_partial = False
        cuda = [m for m in self.movers if isinstance(m, CudaPageMover)]
        # Pages move on it with the kernels; else torch copies.
        self._stream = cuda[0].stream if cuda else None
        if cuda and len(cuda) != len(self.movers):
            raise LayoutMismatch("every KV-cache group must use the CUDA page mover, or none")

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: BlockTransferSpec) -> bool:
        """Copy the pages of ``dst_spec.keys`` out of the engine now and run the manager's plan
        (``OffloadRuntime.store``)."""
        keys = list(dst_spec.keys)
        rows: list[torch.Tensor | None] | None = None  # per key when groups split the batch
        batch: torch.Tensor | None = None
        nbytes = 0
        groups = split_by_group(keys, src_spec.block_ids, getattr(src_spec, "group_sizes", ()),
                                len(self.movers))
        if self._stream is None and keys and self._store_direct(job_id, keys, groups, dst_spec):
            return True
        for g, (group_keys, ids) in enumerate(groups):
            if not group_keys:
                continue
            if len(ids) != len(group_keys) * self.blocks_per_chunk:
                if not self._said_partial:
                    self._said_partial = True
                    log.warning("kvtier: a store of %d chunks came with %d engine blocks (sliding-window or "
                                "null blocks); such chunks are not offloaded", len(group_keys), len(ids))
                continue
            raw = self.runtime.empty_rows(g, len(group_keys), pinned=self._stream is not None)
            self.movers[g].gather(ids, raw)
            nbytes += raw.numel()
            if len(group_keys) == len(keys):  # one group holds every key, in order: its rows are the batch
                batch = raw
                continue
            if rows is None:  # a chunk without its pages: its writes fail
                rows = [None] * len(keys)
                order = {key: i for i, key in enumerate(keys)}
            for key, row in zip(group_keys, raw, strict=True):
                rows[order[key]] = row
        future = self.runtime.store(dst_spec.plan, keys, batch if batch is not None else
                                    rows if rows is not None else [None] * len(keys),
                                    self._copies_done(), placed=dst_spec.placed)
        self._jobs[job_id] = _Job(future, is_load=False, nbytes=nbytes, started=time.perf_counter())
        return True

    def submit_load(self, job_id: int, src_spec: BlockTransferSpec, dst_spec: Any) -> bool:
        """Copy the leased blocks now (memory copies); ``get_finished`` writes them into the engine's
        pages."""
        keys, sources = list(src_spec.keys), list(src_spec.sources)
        groups = split_by_group(keys, dst_spec.block_ids, getattr(dst_spec, "group_sizes", ()),
                                len(self.movers))
        starts = list(getattr(dst_spec, "block_indices", ())) or [0] * len(groups)
        moves = []
        for g, (group_keys, ids) in enumerate(groups):
            if not group_keys or not len(ids):
                continue
            skip = starts[g] % self.blocks_per_chunk
            if skip + len(ids) > len(group_keys) * self.blocks_per_chunk:
                raise LayoutMismatch(f"load of {len(ids)} engine blocks from {len(group_keys)} chunks "
                                     f"(skipping {skip}) does not fit")
            moves.append((g, group_keys, ids, skip))
        if len(moves) == 1 and len(moves[0][1]) == len(keys) and \
                self._load_direct(job_id, keys, sources, moves[0], src_spec.placed):
            return True
        buffers: list[tuple[list[BlockKey], torch.Tensor]] = []
        scatters = []
        nbytes = 0
        for g, group_keys, ids, skip in moves:
            raw = self.runtime.empty_rows(g, len(group_keys), pinned=self._stream is not None)
            buffers.append((group_keys, raw))
            scatters.append((self.movers[g], raw, ids, skip))
            nbytes += raw.numel()
        read_keys, read_sources, read_into, unread = _reads(keys, sources, buffers)
        if unread and not src_spec.placed:  # a manager in another process releases its own pins
            self.runtime.release([keys[i] for i in unread], [sources[i] for i in unread])
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        try:
            future.set_result(self.runtime.read(read_keys, read_sources, read_into, placed=src_spec.placed))
        except Exception as exc:  # reported by get_finished as a failed job, never raised into the step
            future.set_exception(exc)
        job = _Job(future, is_load=True, nbytes=nbytes, started=time.perf_counter(), scatters=scatters)
        if self._stream is not None and future.exception() is None and future.result():
            # The kernels write the pages now, on the stream.
            for mover, blocks, engine_ids, start in scatters:
                mover.scatter(blocks, engine_ids, start)
            job.copied = self._copies_done()  # the job keeps its host blocks alive until then
        self._jobs[job_id] = job
        return True

    def _load_direct(self, job_id: int, keys: list[BlockKey], sources: list[int],
                     move: tuple[int, list[BlockKey], np.ndarray, int], placed: bool) -> bool:
        """A load of one group's blocks that one CPU tier holds: its engine pages written straight out of
        the tier's slots (``OffloadRuntime.read_with``), with no buffer between — now by torch copies, or
        enqueued on the transfer stream by the kernels (CUDA, page-locked tier), the leases then kept
        until the copies completed; False, nothing done and nothing released, when it cannot go so."""
        cuda = self._stream is not None
        if cuda and not (sources and self.runtime.pinned_cpu_tier(sources[0])):
            return False  # pageable slots: the kernels cannot read them; the buffer path stages them
        g, _, ids, skip = move
        mover = self.movers[g]
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        leases = None
        try:
            done = self.runtime.read_with(
                keys, sources, lambda slab, slots: mover.scatter_rows(slab, slots, ids, skip), placed=placed,
                keep_leases=cuda)
        except Exception as exc:  # reported by get_finished as a failed job, never raised into the step
            if cuda:  # no copy that was enqueued may still read the slots once they are released
                cast("torch.cuda.Stream", self._stream).synchronize()
                self.runtime.release(keys, sources)
            future.set_exception(exc)
        else:
            if done is None:
                return False
            future.set_result(done)
            leases = (keys, sources) if cuda else None
        self._jobs[job_id] = _Job(future, is_load=True, nbytes=self._nbytes(keys),
                                  started=time.perf_counter(), copied=self._copies_done(), leases=leases)
        return True

    def _store_direct(self, job_id: int, keys: list[BlockKey],
                      groups: list[tuple[list[BlockKey], np.ndarray]], dst_spec: BlockTransferSpec) -> bool:
        """A store whose keys are all of one group, gathered from the host pages straight into the CPU
        tiers' slots (``OffloadRuntime.store_with``); False, nothing done, when it cannot go so."""
        whole = [(g, ids) for g, (group_keys, ids) in enumerate(groups) if len(group_keys) == len(keys)]
        if len(whole) != 1:
            return False
        g, ids = whole[0]
        bpc = self.blocks_per_chunk
        if len(ids) != len(keys) * bpc:
            return False  # chunks without their pages: the general path names them
        mover = self.movers[g]

        def fill(slab: torch.Tensor, slots: list[int], idx: list[int] | None) -> None:
            if idx is None:
                mover.gather_rows(ids, slab, slots)
            elif bpc == 1:
                mover.gather_rows(ids[idx], slab, slots)
            else:
                mover.gather_rows(ids.reshape(-1, bpc)[idx].reshape(-1), slab, slots)

        future = self.runtime.store_with(dst_spec.plan, keys, fill, placed=dst_spec.placed,
                                         offload_keys=getattr(dst_spec, "offload_keys", ()))
        if future is None:
            return False
        self._jobs[job_id] = _Job(future, is_load=False, nbytes=self._nbytes(keys),
                                  started=time.perf_counter())
        return True

    def _nbytes(self, keys: list[BlockKey]) -> int:
        """Bytes of a direct job's blocks (keys of one group)."""
        return len(keys) * self.runtime.core.layouts[keys[0].group_id].nbytes

    def _copies_done(self) -> Any:
        """An event after the page copies enqueued so far on the transfer stream (None without CUDA)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def get_finished(self) -> list[Any]:
        """Results of the jobs that finished since the last call; loads land in the engine's pages here."""
        results = []
        for job_id, job in list(self._jobs.items()):
            if not job.future.done() or (job.copied is not None and not job.copied.query()):
                continue
            del self._jobs[job_id]
            self._release(job)
            results.append(self._finish(job_id, job))
        return results

    def _release(self, job: _Job) -> None:
        """Give back the leases a CUDA load read its slots under (its copies have completed)."""
        if job.leases is not None:
            keys, sources = job.leases
            job.leases = None
            self.runtime.release(keys, sources)

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results still come from ``get_finished``)."""
        jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        if not all(job.future.done() for job in jobs):  # stores into CPU tiers finished in submit_store
            concurrent.futures.wait([job.future for job in jobs])
        for job in jobs:
            if job.copied is not None:
                job.copied.synchronize()

    def shutdown(self) -> None:
        self.wait(set(self._jobs))
        for job in self._jobs.values():
            self._release(job)
        self._jobs.clear()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def _finish(self, job_id: int, job: _Job) -> Any:
        try:
            ok = bool(job.future.result())
        except Exception:
            log.exception("kvtier: transfer job %d failed", job_id)
            ok = False
        if not job.is_load:
            ok = True  # a refused store is a later miss, never an engine error
        elif ok:  # torch copies write the pages here; the kernels already did (job.copied)
            if job.copied is None:
                for mover, raw, ids, skip in job.scatters:
                    mover.scatter(raw, ids, skip)
        else:
            log.error("kvtier: load job %d could not read every leased block; failing it rather than "
                      "feeding the engine wrong KV", job_id)
        return self.result_type(job_id=job_id, success=ok, transfer_size=job.nbytes,
                                transfer_time=time.perf_counter() - job.started)
