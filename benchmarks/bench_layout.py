"""How much the cross-layer layout saves when blocks leave the engine's KV cache.

Why the layout exists: docs/architecture.md#cross-layer-blocks.

Moves N engine blocks of a Llama-3.1-8B-shaped cache (32 layers, 8 KV heads, head_dim 128, fp16,
16-token blocks: 2 MiB per cross-layer block) into a contiguous destination, four ways, measured in
the same run against the same baseline:

* per-layer, naive: ``2 × num_layers`` copies per block (the baseline, what classic offload does),
* per-layer, ``pack_blocks``: the torch reference gather, i.e. the page mover's (``kvtier.pages``)
  gather over the layers as regions, one batched op per layer,
* cross-layer, one copy per block (the source made with ``make_cross_layer_kv``),
* cross-layer, ``copy_blocks``: one batched copy for all blocks.

Every method's result is checked against the baseline's, so a fast wrong method cannot win.
Run: ``python benchmarks/bench_layout.py [--blocks N] [--device cpu|cuda] [--repeats R] [--threads T]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from kvtier.detect import detect_kv_layout, make_cross_layer_kv
from kvtier.kernels import copy_blocks, pack_blocks
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per call (default 256)")
    parser.add_argument("--pool", type=int, default=0,
                        help="engine blocks in the source cache (default 2 × blocks; ids are a random "
                             "subset)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per method (default 5)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable numbers on a shared machine)")
    return parser.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_round_robin(methods: list[Callable[[], None]], repeats: int,
                      device: torch.device) -> list[list[float]]:
    """Seconds of each call, the methods taking turns so a load spike on a shared machine hits all alike."""
    samples: list[list[float]] = [[] for _ in methods]
    for _ in range(repeats):
        for method, times in zip(methods, samples, strict=True):
            sync(device)
            start = time.perf_counter()
            method()
            sync(device)
            times.append(time.perf_counter() - start)
    return samples


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # Llama-3.1-8B
    block = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16)
    num_blocks = args.pool or 2 * args.blocks
    per_layer = PerLayerLayout(PerLayerKind.FLASH_ATTN, "NHD")

    base, views = make_cross_layer_kv(num_blocks, block, device)
    base.view(torch.int16).random_(generator=torch.Generator(device).manual_seed(0))
    layers = [view.contiguous() for view in views]  # classic layout: one tensor per layer, same contents
    cross = detect_kv_layout(views, block_size=block.block_size, num_kv_heads=block.num_kv_heads,
                             head_dim=block.head_dim)
    classic = detect_kv_layout(layers, block_size=block.block_size, num_kv_heads=block.num_kv_heads,
                               head_dim=block.head_dim)
    assert cross.cross_layer and cross.base is not None and not classic.cross_layer

    generator = torch.Generator().manual_seed(1)
    ids = torch.randperm(num_blocks, generator=generator)[: args.blocks].to(device)
    id_list = ids.tolist()
    dst = torch.empty((args.blocks, *block.shape), dtype=block.dtype, device=device)
    dst_ids = torch.arange(args.blocks, device=device)
    cross_base = cross.base

    def per_layer_naive() -> None:
        for i, engine_block in enumerate(id_list):
            for layer, tensor in enumerate(layers):
                for kv in range(2):
                    dst[i, layer, kv].copy_(tensor[kv, engine_block])

    def per_layer_pack() -> None:
        pack_blocks(layers, ids, per_layer, block, dst)

    def cross_layer_per_block() -> None:
        for i, engine_block in enumerate(id_list):
            dst[i].copy_(cross_base[engine_block])

    def cross_layer_batched() -> None:
        copy_blocks(cross_base, ids, dst, dst_ids)

    methods = [
        ("per-layer, naive (baseline)", f"{2 * block.num_layers} copies/block", per_layer_naive),
        ("per-layer, pack_blocks", f"{block.num_layers} index_select/call", per_layer_pack),
        ("cross-layer, one copy per block", "1 copy/block", cross_layer_per_block),
        ("cross-layer, copy_blocks", "1 index_select/call", cross_layer_batched),
    ]
    moved = args.blocks * block.nbytes
    reference: torch.Tensor | None = None
    for name, _, fn in methods:  # warm-up, and proof that every method moves the baseline's bytes
        dst.zero_()
        fn()
        sync(device)
        if reference is None:
            reference = dst.clone()
        elif not torch.equal(dst.view(torch.int16), reference.view(torch.int16)):
            raise SystemExit(f"{name} moved different bytes than the baseline")
    samples = timed_round_robin([fn for _, _, fn in methods], args.repeats, device)

    baseline = statistics.median(samples[0])
    table = Table(title=f"Moving {args.blocks} blocks of {block.describe()} "
                        f"({block.nbytes / 2**20:.0f} MiB each, {moved / 2**20:.0f} MiB per call) "
                        f"from a {num_blocks}-block cache on {device}")
    for column, justify in (("method", "left"), ("ops", "left"), ("median ms", "right"), ("best ms", "right"),
                            ("GB/s", "right"), ("vs baseline", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for (name, ops, _), times in zip(methods, samples, strict=True):
        median = statistics.median(times)
        table.add_row(name, ops, f"{median * 1e3:.1f}", f"{min(times) * 1e3:.1f}",
                      f"{moved / median / 1e9:.2f}", f"{baseline / median:.2f}×")
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), {args.repeats} timed "
                  f"calls per method taking turns after 1 warm-up; GB/s and ratio from the median; load "
                  f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    console.print("command: python benchmarks/bench_layout.py " + " ".join(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
