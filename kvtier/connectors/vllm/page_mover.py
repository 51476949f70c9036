"""Engine KV pages ↔ kvtier offloaded blocks: torch copies anywhere, kvtier's copy kernel on CUDA."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.connectors.vllm.runtime import OffloadRuntime
from kvtier.errors import LayoutMismatch, TierUnavailable

log = logging.getLogger(__name__)


class PageMover:
    """Moves one KV-cache group's engine pages ↔ kvtier offloaded blocks, with torch on any device.

    ``regions`` are the group's ``(rows, page_bytes)`` pairs in layer order: ``rows`` is a
    ``[num_blocks, row_bytes]`` byte view of the engine's KV memory and the first ``page_bytes`` of
    row ``b`` are that layer's part of engine block ``b`` (vLLM's ``CanonicalKVCaches``). An
    offloaded block of ``blocks_per_chunk`` engine blocks is laid out ``[region][engine block][page]``:
    per-layer pages are packed into one cross-layer block; a block-compact group (one region holding
    every layer) moves with one copy per engine block.
    """

    def __init__(self, regions: Sequence[tuple[torch.Tensor, int]], blocks_per_chunk: int, block_bytes: int) -> None:
        if not regions:
            raise LayoutMismatch("a KV-cache group with no KV pages cannot be offloaded")
        pages = [page for _, page in regions]
        if sum(pages) * blocks_per_chunk != block_bytes:
            raise LayoutMismatch(
                f"the engine's pages hold {sum(pages)} bytes per block ({len(pages)} regions of {sorted(set(pages))} "
                f"bytes) × {blocks_per_chunk} blocks per chunk = {sum(pages) * blocks_per_chunk} bytes, but kvtier's "
                f"block layout has {block_bytes}; check model.num_kv_heads, model.head_dim and model.dtype "
                f"(quantised KV caches with per-token scales are not supported)")
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        self.regions = [(rows.view(torch.uint8)[:, :page], page) for rows, page in regions]
        self.device = self.regions[0][0].device
        offsets, offset = [], 0
        for page in pages:
            offsets.append(offset)
            offset += page * blocks_per_chunk
        self.offsets = offsets
        # per region: base address and byte stride of its rows, page size and offset in a block
        self._ptrs = torch.tensor([rows.data_ptr() for rows, _ in self.regions], dtype=torch.int64)
        self._strides = torch.tensor([rows.stride(0) for rows, _ in self.regions], dtype=torch.int64)
        self._pages = torch.tensor(pages, dtype=torch.int64)
        self._offsets = torch.tensor(offsets, dtype=torch.int64)
        self._page_sizes = sorted(set(pages))

    @property
    def cross_layer(self) -> bool:
        return len(self.regions) == 1

    def piece_addresses(self, block_ids: torch.Tensor, blocks_base: int,
                        skip: int = 0) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where every page of a move is: ``(page bytes, engine addresses, block addresses)`` per page size.

        Engine block ``block_ids[k]`` is position ``skip + k`` of the offloaded blocks, which lie
        ``block_bytes`` apart from ``blocks_base`` (so chunk ``(skip + k) // blocks_per_chunk``, engine
        block ``(skip + k) % blocks_per_chunk`` within it). This is the whole address math of
        :class:`CudaPageMover`'s copies, computed with vectorised torch on the host; the CPU tests
        replay it with ``memmove`` and compare with :meth:`gather` / :meth:`scatter`.
        """
        ids = block_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        position = torch.arange(skip, skip + ids.numel(), dtype=torch.int64)
        chunk, within = position // self.blocks_per_chunk, position % self.blocks_per_chunk
        engine = self._ptrs[:, None] + ids[None, :] * self._strides[:, None]
        cross = (blocks_base + chunk * self.block_bytes)[None, :] + self._offsets[:, None] \
            + within[None, :] * self._pages[:, None]
        if len(self._page_sizes) == 1:
            return [(self._page_sizes[0], engine.reshape(-1), cross.reshape(-1))]
        return [(page, engine[self._pages == page].reshape(-1), cross[self._pages == page].reshape(-1))
                for page in self._page_sizes]

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` (``n × blocks_per_chunk`` of them) into ``out`` ``[n, block_bytes]``."""
        n = block_ids.numel() // self.blocks_per_chunk
        ids = block_ids.to(self.device)
        for (rows, page), offset in zip(self.regions, self.offsets, strict=True):
            span = page * self.blocks_per_chunk
            out[:, offset:offset + span].view(n, self.blocks_per_chunk, page).copy_(
                rows.index_select(0, ids).view(n, self.blocks_per_chunk, page))

    def scatter(self, blocks: torch.Tensor, block_ids: torch.Tensor, skip: int = 0) -> None:
        """Write engine blocks ``block_ids`` from offloaded ``blocks``, starting ``skip`` engine blocks in."""
        n = blocks.shape[0]
        count = block_ids.numel()
        ids = block_ids.to(self.device)
        for (rows, page), offset in zip(self.regions, self.offsets, strict=True):
            span = page * self.blocks_per_chunk
            pages = blocks[:, offset:offset + span].reshape(n * self.blocks_per_chunk, page)[skip:skip + count]
            rows.index_copy_(0, ids, pages.to(self.device))


class CudaPageMover(PageMover):
    """A :class:`PageMover` for a CUDA engine: one kernel launch per page size moves every page of a move.

    The offloaded blocks are page-locked host memory, which the kernel reaches through its mapped
    address, so a store's pages go from the engine's KV memory straight into the buffer kvtier
    stores, and a load's come straight back: no per-layer ``cudaMemcpyAsync`` and no device staging.
    Copies run on ``stream`` (the worker's transfer stream), which first waits for the engine's
    current stream: a store reads only what the engine's kernels wrote, and a load never overwrites
    a page that an earlier kernel still reads. Nothing here waits on the host; callers record an
    event on ``stream`` and keep the host buffer alive until it completed.
    """

    def __init__(self, regions: Sequence[tuple[torch.Tensor, int]], blocks_per_chunk: int, block_bytes: int,
                 stream: torch.cuda.Stream) -> None:
        super().__init__(regions, blocks_per_chunk, block_bytes)
        if self.device.type != "cuda":
            raise LayoutMismatch(f"CudaPageMover needs the engine's KV pages on a CUDA device, got {self.device}")
        from kvtier.kernels import cuda as kernels

        kernels.require_cuda()
        self._kernels = kernels
        self.stream = stream
        self._engine_unit = kernels.vector_unit(*self._ptrs.tolist(), *self._strides.tolist(), *self._pages.tolist(),
                                                *self._offsets.tolist(), block_bytes)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        self._move(block_ids, out, 0, into_engine=False)

    def scatter(self, blocks: torch.Tensor, block_ids: torch.Tensor, skip: int = 0) -> None:
        self._move(block_ids, blocks, skip, into_engine=True)

    def _move(self, block_ids: torch.Tensor, blocks: torch.Tensor, skip: int, *, into_engine: bool) -> None:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.block_bytes \
                or not blocks.is_contiguous():
            raise LayoutMismatch(f"offloaded blocks must be a contiguous [n, {self.block_bytes}] uint8 tensor, got "
                                 f"{blocks.dtype} {tuple(blocks.shape)}")
        if blocks.device.type != "cuda" and not blocks.is_pinned():
            raise LayoutMismatch("the CUDA page mover needs page-locked host blocks (pin_memory=True) or device "
                                 f"blocks, got pageable memory on {blocks.device}")
        unit = min(self._engine_unit, self._kernels.vector_unit(blocks.data_ptr()))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for page, engine, cross in self.piece_addresses(block_ids, blocks.data_ptr(), skip):
                engine_at, cross_at = torch.stack([engine, cross]).to(self.device, non_blocking=True)  # one copy
                src, dst = (cross_at, engine_at) if into_engine else (engine_at, cross_at)
                self._kernels.copy_addresses(src, dst, page, unit=unit, stream=self.stream)


def page_movers(kv_caches: Any, runtime: OffloadRuntime, blocks_per_chunk: int) -> list[PageMover]:
    """One page mover per offloaded group, from vLLM's ``CanonicalKVCaches`` (read by attribute).

    On a CUDA engine with CuPy installed: :class:`CudaPageMover` (kvtier's copy kernel, one transfer
    stream for all groups); otherwise :class:`PageMover` (torch copies: vLLM's CPU backend, or CUDA
    without CuPy, which is logged once).
    """
    groups = [[(kv_caches.tensors[ref.tensor_idx].tensor, int(ref.page_size_bytes)) for ref in refs]
              for refs in kv_caches.group_data_refs]
    device = next((rows.device for regions in groups for rows, _ in regions), torch.device("cpu"))
    stream = None
    if device.type == "cuda":
        from kvtier.kernels import cuda as kernels

        try:
            kernels.require_cuda()
            stream = torch.cuda.Stream(device=device)
        except TierUnavailable as exc:
            log.warning("kvtier: %s; moving vLLM's KV pages with torch copies instead of kvtier's kernels", exc)
    movers: list[PageMover] = []
    for g, regions in enumerate(groups):
        try:
            nbytes = runtime.core.layouts[g].nbytes
            movers.append(CudaPageMover(regions, blocks_per_chunk, nbytes, stream) if stream is not None
                          else PageMover(regions, blocks_per_chunk, nbytes))
        except LayoutMismatch as exc:
            raise LayoutMismatch(f"KV-cache group {runtime.codec.vllm_group_ids[g]}: {exc}") from None
    return movers
