"""vLLM's KV pages as :mod:`kvtier.pages` regions: one page mover per offloaded KV-cache group."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.connectors.vllm.runtime import OffloadRuntime
from kvtier.errors import LayoutMismatch
from kvtier.pages import CudaPageMover, PageMover, page_mover, transfer_stream

__all__ = ["CudaPageMover", "PageMover", "page_movers"]


def page_movers(kv_caches: Any, runtime: OffloadRuntime, blocks_per_chunk: int) -> list[PageMover]:
    """One page mover per offloaded group, from vLLM's ``CanonicalKVCaches`` (read by attribute).

    A group's regions are its ``(rows, page_bytes)`` pairs in layer order: ``rows`` is a
    ``[num_blocks, row_bytes]`` view of the engine's KV memory and the first ``page_bytes`` of row
    ``b`` are that layer's part of engine block ``b``. On a CUDA engine with CuPy installed:
    :class:`CudaPageMover` (kvtier's copy kernel, one transfer stream for all groups); otherwise
    :class:`PageMover` (torch copies: vLLM's CPU backend, or CUDA without CuPy, which is logged once).
    """
    groups = [[(kv_caches.tensors[ref.tensor_idx].tensor, int(ref.page_size_bytes)) for ref in refs]
              for refs in kv_caches.group_data_refs]
    device = next((rows.device for regions in groups for rows, _ in regions), torch.device("cpu"))
    stream = transfer_stream(device)
    movers: list[PageMover] = []
    for g, regions in enumerate(groups):
        try:
            movers.append(page_mover(regions, blocks_per_chunk, runtime.core.layouts[g].nbytes, stream))
        except LayoutMismatch as exc:
            raise LayoutMismatch(f"KV-cache group {runtime.codec.vllm_group_ids[g]}: {exc}") from None
    return movers
