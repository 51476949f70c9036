"""Engine KV pages ⇄ kvtier's cross-layer blocks: the one page mover every connector uses.

An engine's KV cache is described once, as *regions* in layer order: tensors whose dim 0 is the
engine block and whose entry ``b`` is that region's *page* of engine block ``b`` — ``rows`` rows of
``row_bytes``, each row contiguous, rows any stride apart (a region holding every layer is a
cross-layer, block-compact cache). An offloaded kvtier block of ``blocks_per_chunk`` engine blocks
is laid out ``[region][engine block][page]`` with every page dense, so per-layer pages are packed
into one cross-layer block on the way out and unpacked on the way in.

:class:`PageMover` moves pages with torch copies on any device; :class:`CudaPageMover` with one
launch of kvtier's copy kernel per row size, from CUDA pages straight into device or page-locked
host blocks (and back); :func:`page_mover` picks one. vLLM's worker, the transformers adapter and the
SGLang backend each describe their engine's layout as regions and move pages through this module.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple, TypeAlias, cast

import numpy as np
import torch

from kvtier.errors import LayoutMismatch, TierUnavailable
from kvtier.tiers.buffers import strided_rows

__all__ = ["BlockIds", "CudaPageMover", "PageMover", "Region", "page_mover", "transfer_stream"]

log = logging.getLogger(__name__)

#: One region: a ``[num_blocks, rows, row_elements]`` or ``[num_blocks, elements]`` tensor (last dim
#: contiguous; the page of block ``b`` is entry ``b``), or ``(rows, page_bytes)``: the first
#: ``page_bytes`` bytes of each row of a 2-D ``[num_blocks, row]`` tensor (vLLM's ``CanonicalKVCaches``).
Region: TypeAlias = torch.Tensor | tuple[torch.Tensor, int]
#: Engine block ids: a tensor or a numpy array of integers, or a ``range`` of step 1 (moved by slicing,
#: without an index gather).
BlockIds: TypeAlias = torch.Tensor | np.ndarray | range

#: Integer dtype of each width: copies move words of the widest width every address allows.
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


class _Pieces(NamedTuple):
    ptrs: torch.Tensor
    strides: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    steps: torch.Tensor


class PageMover:
    """Moves one engine layout's pages ⇄ kvtier blocks of ``block_bytes``, with torch on any device.

    ``regions`` are the engine's pages in layer order (see :data:`Region`). The pages of one block
    must add up to ``block_bytes`` over ``blocks_per_chunk`` engine blocks, else
    :class:`LayoutMismatch` says so. :meth:`gather` and :meth:`scatter` take offloaded blocks as a
    ``[n, block_bytes]`` uint8 tensor (rows contiguous) or any contiguous tensor of ``n`` blocks.
    """

    def __init__(self, regions: Sequence[Region], blocks_per_chunk: int, block_bytes: int) -> None:
        if not regions:
            raise LayoutMismatch("a KV-cache group with no KV pages cannot be offloaded")
        if blocks_per_chunk <= 0:
            raise LayoutMismatch(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
        self.pages = [_page_rows(region, index) for index, region in enumerate(regions)]
        sizes = [math.prod(rows.shape[1:]) for rows in self.pages]
        if sum(sizes) * blocks_per_chunk != block_bytes:
            raise LayoutMismatch(
                f"the engine's pages hold {sum(sizes)} bytes per block ({len(sizes)} regions of "
                f"{sorted(set(sizes))} bytes) × {blocks_per_chunk} blocks per chunk = "
                f"{sum(sizes) * blocks_per_chunk} bytes, but kvtier's block layout has {block_bytes}; check "
                f"model.num_kv_heads, model.head_dim and model.dtype (quantised KV caches with per-token "
                f"scales are not supported)")
        self.device = self.pages[0].device
        if any(rows.device != self.device for rows in self.pages):
            devices = sorted({str(rows.device) for rows in self.pages})
            raise LayoutMismatch(f"all KV pages must be on one device, got {devices}")
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        self.num_blocks = min(rows.shape[0] for rows in self.pages)
        self.page_sizes = sizes
        self.offsets: list[int] = []
        offset = 0
        for size in sizes:
            self.offsets.append(offset)
            offset += size * blocks_per_chunk
        self._words = [_word(*rows.shape[-1:], *_strides(rows), int(rows.storage_offset()), offset, size)
                       for rows, offset, size in zip(self.pages, self.offsets, sizes, strict=True)]
        #: host pages as numpy arrays of their words: a worker moves a few KiB per job, where numpy's
        #: per-call cost is a fraction of torch's (views, index_select, index_copy_); None off the host
        self._host = _host_pages(self.pages, self._words) if self.device.type == "cpu" else None
        #: the same as ``[num_blocks, words]`` where every page is one dense row and a chunk is one engine
        #: block (the usual case): a move is then one ``np.take`` or indexed assignment per region
        self._last_slab: tuple[torch.Tensor, np.ndarray] | None = None  # see _slab_rows
        self._host_rows = [pages.reshape(pages.shape[0], -1) for pages in self._host] \
            if self._host is not None and blocks_per_chunk == 1 and all(p.shape[1] == 1 for p in self._host) \
            else None

    @functools.cached_property
    def _pieces(self) -> _Pieces:
        """Every row of a page as a piece: its address in engine block 0, the byte stride between
        engine blocks, its bytes, its place in an offloaded block (the region's offset plus the row's)
        and the region's page size (the step between the engine blocks of one chunk)."""
        ptrs, strides, sizes, offsets, steps = [], [], [], [], []
        for rows, offset, size in zip(self.pages, self.offsets, self.page_sizes, strict=True):
            row_at = torch.zeros((), dtype=torch.int64)
            for extent, stride in zip(rows.shape[1:-1], rows.stride()[1:-1], strict=True):
                row_at = row_at[..., None] + torch.arange(extent, dtype=torch.int64) * stride
            count, row_bytes = row_at.numel(), rows.shape[-1]
            ptrs.append(rows.data_ptr() + row_at.reshape(-1))
            strides.append(torch.full((count,), rows.stride(0), dtype=torch.int64))
            sizes.append(torch.full((count,), row_bytes, dtype=torch.int64))
            offsets.append(offset + torch.arange(count, dtype=torch.int64) * row_bytes)
            steps.append(torch.full((count,), size, dtype=torch.int64))
        pieces = _Pieces(*(torch.cat(column) for column in (ptrs, strides, sizes, offsets, steps)))
        return pieces

    @property
    def cross_layer(self) -> bool:
        """One region holds every layer of a block: a block moves as whole contiguous pages."""
        return len(self.pages) == 1

    @property
    def regions(self) -> list[tuple[torch.Tensor, int]]:
        """``(rows, page_bytes)`` per region: ``rows`` a ``[num_blocks, ..., row_bytes]`` uint8 view."""
        return list(zip(self.pages, self.page_sizes, strict=True))

    def block_view(self, block_id: int) -> torch.Tensor | None:
        """Engine block ``block_id`` as the bytes of one kvtier block, without a copy.

        ``None`` when its pages are not one contiguous region (per-layer regions, strided rows, several
        engine blocks per chunk): those blocks move with :meth:`gather` and :meth:`scatter`.
        """
        rows = self.pages[0]
        dense = rows.dim() == 3 and rows.shape[1] == 1  # a dense page collapses into one row
        if not self.cross_layer or self.blocks_per_chunk != 1 or not dense:
            return None
        if not 0 <= block_id < self.num_blocks:
            raise LayoutMismatch(f"engine block {block_id} out of range [0, {self.num_blocks})")
        return rows[block_id].view(-1)

    def piece_addresses(self, block_ids: BlockIds, blocks_base: int, skip: int = 0, *,
                        chunk_bases: torch.Tensor | None = None
                        ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where every piece of a move is: ``(piece bytes, engine addresses, block addresses)`` by size.

        A piece is one contiguous row of a page (a whole page when rows are dense). Engine block
        ``block_ids[k]`` is position ``skip + k`` of the offloaded blocks, which lie ``block_bytes``
        apart from ``blocks_base`` (chunk ``(skip + k) // blocks_per_chunk``, engine block ``(skip + k)
        % blocks_per_chunk`` within it), or, with ``chunk_bases`` (int64, one address per chunk: the
        rows of a CPU tier's slab that a move reads or fills), at those addresses. This is the whole
        address math of :class:`CudaPageMover`'s copies, computed with vectorised torch on the host; the
        CPU tests replay it with ``memmove`` and compare with :meth:`gather` / :meth:`scatter`.
        """
        ids = _as_tensor(block_ids).reshape(-1).to(device="cpu", dtype=torch.int64)
        position = torch.arange(skip, skip + ids.numel(), dtype=torch.int64)
        chunk, within = position // self.blocks_per_chunk, position % self.blocks_per_chunk
        p = self._pieces
        engine = p.ptrs[:, None] + ids[None, :] * p.strides[:, None]
        starts = blocks_base + chunk * self.block_bytes if chunk_bases is None else chunk_bases[chunk]
        cross = starts[None, :] + p.offsets[:, None] + within[None, :] * p.steps[:, None]
        sizes = sorted(set(p.sizes.tolist()))
        if len(sizes) == 1:
            return [(sizes[0], engine.reshape(-1), cross.reshape(-1))]
        return [(size, engine[p.sizes == size].reshape(-1), cross[p.sizes == size].reshape(-1))
                for size in sizes]

    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` (``n × blocks_per_chunk`` of them) into ``n`` blocks ``out``."""
        blocks = self._block_rows(out, "out")
        n, bpc = blocks.shape[0], self.blocks_per_chunk
        if self._host is not None and not isinstance(block_ids, range) and blocks.is_cpu:
            self._gather_host(self._host_ids(block_ids, n * bpc, "gather"), blocks.numpy())
            return
        ids = self._ids(block_ids, n * bpc, "gather")
        for rows, offset, size, word in self._regions():
            word = _fit(word, blocks)
            dst = blocks[:, offset:offset + size * bpc].view(n, bpc, *rows.shape[1:])
            if isinstance(ids, slice):
                _as_words(dst, word).copy_(_as_words(rows[ids].view(n, bpc, *rows.shape[1:]), word))
            elif blocks.device == self.device:  # gather straight into place: no temporary
                source = _as_words(rows, word)
                for within in range(bpc):
                    torch.index_select(source, 0, ids[within::bpc], out=_as_words(dst[:, within], word))
            else:
                src = rows.index_select(0, ids).view(n, bpc, *rows.shape[1:])
                _as_words(dst, word).copy_(_as_words(src, word))

    def scatter(self, blocks: torch.Tensor, block_ids: BlockIds, skip: int = 0) -> None:
        """Write engine blocks ``block_ids`` from offloaded ``blocks``, starting ``skip`` engine blocks in."""
        source = self._block_rows(blocks, "blocks")
        n, bpc = source.shape[0], self.blocks_per_chunk
        count = self._scatter_count(block_ids, n, skip)
        if self._host is not None and not isinstance(block_ids, range) and source.is_cpu:
            self._scatter_host(source.numpy(), self._host_ids(block_ids, count, "scatter"), skip)
            return
        ids = self._ids(block_ids, count, "scatter")
        for rows, offset, size, word in self._regions():
            word = _fit(word, source)
            pages = source[:, offset:offset + size * bpc].view(n, bpc, *rows.shape[1:])
            if isinstance(ids, slice) or bpc == 1:
                pages = pages.reshape(n * bpc, *rows.shape[1:])[skip:skip + count].to(self.device)
                if isinstance(ids, slice):
                    _as_words(rows[ids], word).copy_(_as_words(pages, word))
                else:
                    _as_words(rows, word).index_copy_(0, ids, _as_words(pages, word))
                continue
            for within in range(bpc):  # each engine block position of a chunk: no copy of the pages first
                first = (within - skip) % bpc  # the first of block_ids at that position
                if first >= count:
                    continue
                chunk = (skip + first) // bpc
                taken = ids[first::bpc]
                src = pages[chunk:chunk + taken.numel(), within].to(self.device)
                _as_words(rows, word).index_copy_(0, taken, _as_words(src, word))

    def gather_rows(self, block_ids: BlockIds, slab: torch.Tensor, slots: Sequence[int]) -> None:
        """:meth:`gather` of engine blocks ``block_ids`` (``len(slots) × blocks_per_chunk`` of them) straight
        into rows ``slots`` of ``slab`` (a ``[m, block_bytes]`` uint8 tensor: a CPU tier's slab), with no
        buffer between: one ``np.take`` per region into the rows when the slots step evenly (what a free
        list hands out), else one indexed assignment per region. Pages that are not one dense row per
        engine block, or off the host, go through :meth:`gather` and one indexed copy."""
        n = len(slots)
        if not n:
            return
        if self._host_rows is not None and slab.is_cpu and not isinstance(block_ids, range):
            ids = self._host_ids(block_ids, n, "gather")
            slab_np = self._slab_rows(slab)
            run = strided_rows(slab_np, slots)
            at = None if run is not None else np.asarray(slots, dtype=np.intp)
            for rows, offset, size in zip(self._host_rows, self.offsets, self.page_sizes, strict=True):
                if run is not None:
                    # ids are checked in range: "clip" writes straight into the rows, unbuffered
                    np.take(rows, ids, axis=0, out=run[:, offset:offset + size].view(rows.dtype), mode="clip")
                else:
                    slab_np[:, offset:offset + size].view(rows.dtype)[at] = rows[ids]
            return
        staged = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=slab.device)
        self.gather(block_ids, staged)
        slab.index_copy_(0, torch.as_tensor(list(slots), dtype=torch.int64, device=slab.device), staged)

    def scatter_rows(self, slab: torch.Tensor, slots: Sequence[int], block_ids: BlockIds,
                     skip: int = 0) -> None:
        """:meth:`scatter` of the offloaded blocks in rows ``slots`` of ``slab`` (a CPU tier's slab) straight
        into engine blocks ``block_ids``, starting ``skip`` engine blocks in; no buffer between on the host
        (see :meth:`gather_rows`)."""
        count = self._scatter_count(block_ids, len(slots), skip)
        if not count:
            return
        if self._host_rows is not None and slab.is_cpu and not isinstance(block_ids, range):
            ids = self._host_ids(block_ids, count, "scatter")  # one engine block per chunk: skip is 0
            slab_np = self._slab_rows(slab)
            run = strided_rows(slab_np, slots[:count])
            at = None if run is not None else np.asarray(slots[:count], dtype=np.intp)
            for rows, offset, size in zip(self._host_rows, self.offsets, self.page_sizes, strict=True):
                if run is not None:
                    rows[ids] = run[:, offset:offset + size].view(rows.dtype)
                else:
                    rows[ids] = slab_np[at, offset:offset + size].view(rows.dtype)
            return
        staged = slab.index_select(0, torch.as_tensor(list(slots), dtype=torch.int64, device=slab.device))
        self.scatter(staged, block_ids, skip)

    def _scatter_count(self, block_ids: BlockIds, chunks: int, skip: int) -> int:
        """How many engine blocks a scatter writes, checked to fit in ``chunks`` offloaded blocks after
        ``skip``."""
        count = len(block_ids) if isinstance(block_ids, range) else \
            block_ids.size if isinstance(block_ids, np.ndarray) else _as_tensor(block_ids).numel()
        if skip < 0 or skip + count > chunks * self.blocks_per_chunk:
            raise LayoutMismatch(f"{count} engine blocks from {chunks} offloaded blocks of "
                                 f"{self.blocks_per_chunk} (skipping {skip}) do not fit")
        return count

    def _slab_rows(self, slab: torch.Tensor) -> np.ndarray:
        """``slab`` as numpy rows, checked; the last one is kept (a CPU tier hands the same slab every
        time, and ``Tensor.numpy()`` costs more than a small move's copy)."""
        cached = self._last_slab
        if cached is not None and cached[0] is slab:
            return cached[1]
        if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != self.block_bytes \
                or slab.stride(1) != 1:
            raise LayoutMismatch(f"slab must be a [m, {self.block_bytes}] uint8 tensor (rows contiguous), "
                                 f"got {slab.dtype} {tuple(slab.shape)}")
        rows = cast("np.ndarray", slab.numpy())
        self._last_slab = (slab, rows)
        return rows

    def _gather_host(self, ids: np.ndarray, blocks: np.ndarray) -> None:
        """:meth:`gather` on the host: one ``np.take`` per region (per engine block of a chunk)."""
        n, bpc = blocks.shape[0], self.blocks_per_chunk
        if self._host_rows is not None:
            for rows, offset, size in zip(self._host_rows, self.offsets, self.page_sizes, strict=True):
                np.take(rows, ids, axis=0, out=blocks[:, offset:offset + size].view(rows.dtype))
            return
        for pages, offset, size in zip(cast("list[np.ndarray]", self._host), self.offsets, self.page_sizes,
                                       strict=True):
            # a view (splitting the contiguous last axis never copies): [n, bpc, *page] in the page's words
            dst = blocks[:, offset:offset + size * bpc].view(pages.dtype).reshape(n, bpc, *pages.shape[1:])
            if bpc == 1:
                np.take(pages, ids, axis=0, out=dst[:, 0])
                continue
            for within in range(bpc):
                np.take(pages, ids[within::bpc], axis=0, out=dst[:, within])

    def _scatter_host(self, blocks: np.ndarray, ids: np.ndarray, skip: int) -> None:
        """:meth:`scatter` on the host: one indexed assignment per region (per engine block of a chunk)."""
        n, bpc, count = blocks.shape[0], self.blocks_per_chunk, ids.shape[0]
        if self._host_rows is not None:
            for rows, offset, size in zip(self._host_rows, self.offsets, self.page_sizes, strict=True):
                rows[ids] = blocks[skip:skip + count, offset:offset + size].view(rows.dtype)
            return
        for pages, offset, size in zip(cast("list[np.ndarray]", self._host), self.offsets, self.page_sizes,
                                       strict=True):
            src = blocks[:, offset:offset + size * bpc].view(pages.dtype).reshape(n, bpc, *pages.shape[1:])
            if bpc == 1:
                pages[ids] = src[skip:skip + count, 0]
                continue
            for within in range(bpc):  # each engine block position of a chunk
                first = (within - skip) % bpc  # the first of block_ids at that position
                if first >= count:
                    continue
                chunk = (skip + first) // bpc
                taken = ids[first::bpc]
                pages[taken] = src[chunk:chunk + taken.shape[0], within]

    def _host_ids(self, block_ids: torch.Tensor | np.ndarray, count: int, what: str) -> np.ndarray:
        """Engine block ids as a 1-D numpy integer array, checked in range once for the batch (numpy
        would wrap a negative id around: never served, refused here)."""
        if not isinstance(block_ids, np.ndarray):  # a tensor
            block_ids = block_ids.cpu().numpy()
        ids = block_ids.reshape(-1)
        if ids.shape[0] != count:
            raise LayoutMismatch(f"{what} needs {count} engine block ids, got {ids.shape[0]}")
        if ids.dtype.kind not in "iu":
            raise LayoutMismatch(f"{what}: engine block ids must be integers, got {ids.dtype}")
        # one reduction for both bounds: a negative id read unsigned is past every block
        if count and ids.view(f"u{ids.itemsize}").max() >= self.num_blocks:
            raise LayoutMismatch(f"{what}: engine block ids must lie in [0, {self.num_blocks}), got "
                                 f"{ids.min()} to {ids.max()}")
        return ids

    def _regions(self) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        return zip(self.pages, self.offsets, self.page_sizes, self._words, strict=True)

    def _block_rows(self, blocks: torch.Tensor, what: str) -> torch.Tensor:
        """``blocks`` as ``[n, block_bytes]`` uint8 (a view), or :class:`LayoutMismatch`."""
        if not isinstance(blocks, torch.Tensor):
            raise LayoutMismatch(f"{what} must be a torch.Tensor of offloaded blocks, got "
                                 f"{type(blocks).__name__}")
        if blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == self.block_bytes \
                and blocks.stride(1) == 1:
            return blocks
        nbytes = blocks.numel() * blocks.element_size()
        if blocks.is_contiguous() and blocks.dim() > 0 and nbytes % self.block_bytes == 0:
            return blocks.reshape(-1).view(torch.uint8).view(-1, self.block_bytes)
        raise LayoutMismatch(f"{what} must be a [n, {self.block_bytes}] uint8 tensor (rows contiguous) or a "
                             f"contiguous tensor of whole blocks, got {blocks.dtype} {tuple(blocks.shape)}")

    def _ids(self, block_ids: BlockIds, count: int, what: str) -> torch.Tensor | slice:
        if isinstance(block_ids, range):
            if block_ids.step != 1 or len(block_ids) != count or block_ids.start < 0 \
                    or block_ids.stop > self.num_blocks:
                raise LayoutMismatch(f"{what} needs {count} engine blocks in [0, {self.num_blocks}), "
                                     f"got {block_ids}")
            return slice(block_ids.start, block_ids.stop)
        block_ids = _as_tensor(block_ids)
        if block_ids.numel() != count:
            raise LayoutMismatch(f"{what} needs {count} engine block ids, got {block_ids.numel()}")
        return block_ids.reshape(-1).to(self.device)


class CudaPageMover(PageMover):
    """A :class:`PageMover` for CUDA pages: one kernel launch per piece size moves every page of a move.

    Offloaded blocks may be page-locked host memory, which the kernel reaches through its mapped
    address, so a store's pages go from the engine's KV memory straight into the buffer kvtier
    stores, and a load's come straight back: no per-layer ``cudaMemcpyAsync`` and no device staging.
    Copies run on ``stream`` (a transfer stream), which first waits for the engine's current stream:
    a store reads only what the engine's kernels wrote, and a load never overwrites a page that an
    earlier kernel still reads. Nothing here waits on the host; callers record an event on
    ``stream`` and keep the host buffer alive until it completed.
    """

    def __init__(self, regions: Sequence[Region], blocks_per_chunk: int, block_bytes: int,
                 stream: torch.cuda.Stream) -> None:
        super().__init__(regions, blocks_per_chunk, block_bytes)
        if self.device.type != "cuda":
            raise LayoutMismatch(f"CudaPageMover needs the engine's KV pages on a CUDA device, "
                                 f"got {self.device}")
        from kvtier.kernels import cuda as kernels

        kernels.require_cuda()
        self._kernels = kernels
        self.stream = stream
        p = self._pieces
        self._engine_unit = kernels.vector_unit(*p.ptrs.tolist(), *p.strides.tolist(), *p.sizes.tolist(),
                                                *p.offsets.tolist(), *p.steps.tolist(), block_bytes)

    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        self._move(_as_tensor(block_ids), out, 0, into_engine=False)

    def scatter(self, blocks: torch.Tensor, block_ids: BlockIds, skip: int = 0) -> None:
        self._move(_as_tensor(block_ids), blocks, skip, into_engine=True)

    def gather_rows(self, block_ids: BlockIds, slab: torch.Tensor, slots: Sequence[int]) -> None:
        """:meth:`gather` straight into rows ``slots`` of ``slab`` (a CPU tier's page-locked slab), by the
        kernels, asynchronously on :attr:`stream`: record an event and keep the rows until it completed."""
        if len(slots):
            self._move(_as_tensor(block_ids), slab, 0, into_engine=False, slots=slots)

    def scatter_rows(self, slab: torch.Tensor, slots: Sequence[int], block_ids: BlockIds,
                     skip: int = 0) -> None:
        """:meth:`scatter` straight out of rows ``slots`` of ``slab`` (a CPU tier's page-locked slab), by the
        kernels, asynchronously on :attr:`stream`: the rows must stay as they are (leased) until an event
        recorded after this call completed."""
        if self._scatter_count(block_ids, len(slots), skip):
            self._move(_as_tensor(block_ids), slab, skip, into_engine=True, slots=slots)

    def _move(self, block_ids: torch.Tensor, blocks: torch.Tensor, skip: int, *, into_engine: bool,
              slots: Sequence[int] | None = None) -> None:
        """Copy between the engine's pages and ``blocks`` (``[n, block_bytes]`` uint8, page-locked or on the
        device), whose chunk ``k`` is row ``k`` or, with ``slots``, row ``slots[k]``."""
        rows_ok = blocks.is_contiguous() if slots is None else blocks.stride(1) == 1
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.block_bytes \
                or not rows_ok:
            raise LayoutMismatch(f"offloaded blocks must be a contiguous [n, {self.block_bytes}] uint8 "
                                 f"tensor, got {blocks.dtype} {tuple(blocks.shape)}")
        if blocks.device.type != "cuda" and not blocks.is_pinned():
            raise LayoutMismatch("the CUDA page mover needs page-locked host blocks (pin_memory=True) or "
                                 f"device blocks, got pageable memory on {blocks.device}")
        bases = None
        unit = min(self._engine_unit, self._kernels.vector_unit(blocks.data_ptr()))
        if slots is not None:
            rows = torch.as_tensor(slots, dtype=torch.int64)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= blocks.shape[0]):
                raise LayoutMismatch(f"slots must lie in [0, {blocks.shape[0]}), got "
                                     f"{rows[(rows < 0) | (rows >= blocks.shape[0])][:8].tolist()}")
            bases = blocks.data_ptr() + rows * blocks.stride(0)
            unit = min(unit, self._kernels.vector_unit(blocks.stride(0)))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            moves = self.piece_addresses(block_ids, blocks.data_ptr(), skip, chunk_bases=bases)
            for piece, engine, cross in moves:
                # one host-to-device copy for both address lists
                engine_at, cross_at = torch.stack([engine, cross]).to(self.device, non_blocking=True)
                src, dst = (cross_at, engine_at) if into_engine else (engine_at, cross_at)
                self._kernels.copy_addresses(src, dst, piece, unit=unit, stream=self.stream)


def transfer_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new CUDA stream for :class:`CudaPageMover` on ``device``; ``None`` (torch copies) off CUDA, or
    on CUDA without CuPy (logged: the kernels are missing, not the device)."""
    if device.type != "cuda":
        return None
    from kvtier.kernels import cuda as kernels

    try:
        kernels.require_cuda()
    except TierUnavailable as exc:
        log.warning("kvtier: %s; moving KV pages with torch copies instead of kvtier's kernels", exc)
        return None
    return torch.cuda.Stream(device=device)


def page_mover(regions: Sequence[Region], blocks_per_chunk: int, block_bytes: int,
               stream: torch.cuda.Stream | None = None) -> PageMover:
    """:class:`CudaPageMover` on ``stream`` when one is given (CUDA pages), else :class:`PageMover`."""
    if stream is not None:
        return CudaPageMover(regions, blocks_per_chunk, block_bytes, stream)
    return PageMover(regions, blocks_per_chunk, block_bytes)


def _page_rows(region: Region, index: int) -> torch.Tensor:
    """A region as a ``[num_blocks, *row_dims, row_bytes]`` uint8 view (rows contiguous), with every pair
    of dims that lies densely in memory merged (fewer, longer rows: fewer pieces for the kernel)."""
    what = f"KV region {index}"
    if isinstance(region, tuple):
        rows, page = region
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            raise LayoutMismatch(f"{what}: (rows, page_bytes) needs a 2-D [num_blocks, row] tensor, got "
                                 f"{type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}")
        data = _bytes(rows, what)
        if not 0 < page <= data.shape[1]:
            raise LayoutMismatch(f"{what}: a page of {page} bytes does not fit rows of {data.shape[1]} bytes")
        return data[:, :page].unsqueeze(1)
    if not isinstance(region, torch.Tensor) or region.dim() < 2:
        raise LayoutMismatch(f"{what} must be a [num_blocks, ..., row_elements] tensor, got "
                             f"{type(region).__name__} {tuple(getattr(region, 'shape', ()))}")
    if region.shape[1:].numel() == 0:
        raise LayoutMismatch(f"{what} has empty pages, shape {tuple(region.shape)}")
    data = _bytes(region, what)
    shape, strides = [data.shape[-1]], [1]
    for extent, stride in zip(reversed(data.shape[1:-1]), reversed(data.stride()[1:-1]), strict=True):
        if extent == 1:
            continue
        if stride == shape[0] * strides[0]:  # dense over the dim inside it: one longer dim
            shape[0] *= extent
        else:
            shape.insert(0, extent)
            strides.insert(0, stride)
    if len(shape) == 1:
        shape.insert(0, 1)
        strides.insert(0, shape[1])
    return data.as_strided((data.shape[0], *shape), (data.stride(0), *strides))


def _host_pages(pages: list[torch.Tensor], words: list[int]) -> list[np.ndarray] | None:
    """Each region's page rows as a numpy array of its words (views of the engine's memory); None when
    numpy cannot view one (torch copies then)."""
    try:
        return [_as_words(rows, word).numpy() for rows, word in zip(pages, words, strict=True)]
    except (RuntimeError, TypeError):  # a tensor numpy cannot share (one that requires grad, say)
        return None


def _strides(rows: torch.Tensor) -> list[int]:
    """Byte strides of a page view's block and row dims (torch checks them all when viewing as words,
    even those of a dim of one entry)."""
    return list(rows.stride()[:-1])


def _bytes(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The same memory as uint8 (a view); the last dim, each row of a page, must be contiguous."""
    if tensor.shape[-1] == 1 and tensor.stride(-1) != 1:
        tensor = tensor.as_strided(tensor.shape, (*tensor.stride()[:-1], 1))
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise LayoutMismatch(f"{what}: each row of a page must be contiguous, got shape "
                             f"{tuple(tensor.shape)} strides {tensor.stride()}")
    return tensor.view(torch.uint8)


def _word(*sizes: int) -> int:
    """Widest word (8, 4, 2 or 1 bytes) dividing every size, stride and offset given."""
    return next((width for width in (8, 4, 2) if all(size % width == 0 for size in sizes)), 1)


def _fit(word: int, blocks: torch.Tensor) -> int:
    """``word`` narrowed until it divides the offloaded blocks' stride and start too."""
    while word > 1 and (blocks.stride(0) % word or blocks.storage_offset() % word):
        word //= 2
    return word


def _as_words(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """Bytes as words of ``word`` bytes (a view): torch copies words several times faster than bytes."""
    return tensor if word == 1 else tensor.view(_WORDS[word])


def _as_tensor(block_ids: BlockIds) -> torch.Tensor:
    if isinstance(block_ids, range):
        return torch.arange(block_ids.start, block_ids.stop, block_ids.step, dtype=torch.int64)
    if isinstance(block_ids, np.ndarray):
        return torch.from_numpy(block_ids)
    return block_ids
