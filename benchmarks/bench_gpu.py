"""GPU ↔ pinned host transfer benchmark: cross-layer vs per-layer, kernel vs copy engine (issue 5).

The limit is one large pinned H2D and D2H copy measured in the same run. Then, for a Llama-3.1-8B
block (32 layers × 8 KV heads × 128 dim × 16 tokens, fp16: 2 MiB cross-layer) and a TP=8 70B block
(80 layers × 1 head: 640 KiB), 1,024 random engine blocks are stored (device → pinned host) and
loaded back (host → device) four ways: cross-layer cache via the copy engine (one cudaMemcpyAsync
per block) and via the copy kernel; per-layer cache via one cudaMemcpyAsync per (layer, K|V) piece
(the old way) and via the pack/unpack kernel. Every result is checked bit for bit against
``kvtier.kernels.fallback``. Times are wall clock from enqueue to completion (Python launch overhead
included, since the engine pays it too), best of ``--repeat``.

Usage: python benchmarks/bench_gpu.py [--blocks 1024] [--repeat 3] [--limit-mib 1024]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

import torch

from kvtier.detect import make_cross_layer_kv
from kvtier.kernels import fallback
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout

SHAPES = {
    "llama-3.1-8b (2 MiB)": BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16),
    "70b tp=8 (640 KiB)": BlockLayout(num_layers=80, num_kv_heads=1, head_dim=128, block_size=16),
}
PER_LAYER = PerLayerLayout(PerLayerKind.FLASH_ATTN, "NHD")


def timed(run: Callable[[], None], repeat: int) -> float:
    """Best wall-clock seconds of ``run`` (which must return only once its transfer completed)."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def limit(num_bytes: int, repeat: int) -> dict[str, float]:
    """GB/s of one large pinned copy in each direction: what the link can do."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        return run

    return {"store": num_bytes / timed(copy(host, device), repeat) / 1e9,
            "load": num_bytes / timed(copy(device, host), repeat) / 1e9}


def random_kv(block: BlockLayout, num_blocks: int, cross_layer: bool) -> list[torch.Tensor]:
    if cross_layer:
        base, layers = make_cross_layer_kv(num_blocks, block, "cuda")
        flat = base.view(torch.int16)
        flat.copy_(torch.randint(-2**15, 2**15, flat.shape, dtype=torch.int16, device="cuda"))
        return layers
    return [torch.randint(-2**15, 2**15, PER_LAYER.layer_shape(num_blocks, block), dtype=torch.int16,
                          device="cuda").view(block.dtype) for _ in range(block.num_layers)]


def bench_path(block: BlockLayout, cross_layer: bool, method: str, num_blocks: int, host: torch.Tensor,
               repeat: int) -> tuple[float, float]:
    """(store GB/s, load GB/s) of one path, both verified against the fallback."""
    from kvtier.tiers.gpu import EngineKV

    engine_blocks = num_blocks + num_blocks // 8
    layers = random_kv(block, engine_blocks, cross_layer)
    engine = EngineKV(layers, block_size=block.block_size, num_kv_heads=block.num_kv_heads,
                      head_dim=block.head_dim, method=method)  # type: ignore[arg-type]
    assert engine.detected.cross_layer is cross_layer
    slots = list(host[:num_blocks])
    ids = torch.randperm(engine_blocks)[:num_blocks]
    nbytes = num_blocks * block.nbytes

    engine.store(ids, slots).wait()  # warm-up: compiles the kernels
    store = nbytes / timed(lambda: engine.store(ids, slots).wait(), repeat) / 1e9
    expected = torch.empty((num_blocks, *block.shape), dtype=block.dtype, device="cuda")
    fallback.pack_blocks(layers, ids, PER_LAYER, block, expected)
    if not torch.equal(host[:num_blocks].cuda(), expected.view(torch.uint8).view(num_blocks, -1)):
        raise SystemExit(f"store via {method} ({'cross-layer' if cross_layer else 'per-layer'}) differs from the fallback")

    load_ids = torch.randperm(engine_blocks)[:num_blocks]
    reference = [layer.clone() for layer in layers]
    fallback.unpack_blocks(expected, reference, load_ids, PER_LAYER, block)
    load = nbytes / timed(lambda: engine.load(slots, load_ids).wait(), repeat) / 1e9
    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(layers, reference, strict=True)):
        raise SystemExit(f"load via {method} ({'cross-layer' if cross_layer else 'per-layer'}) differs from the fallback")
    return store, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved each way per path")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    parser.add_argument("--limit-mib", type=int, default=1024, help="size of the large reference copy")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
    from kvtier.kernels.cuda import require_cuda

    require_cuda()
    print(f"# {shlex.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} blocks each way, "
          f"best of {args.repeat}")
    bandwidth = limit(args.limit_mib << 20, args.repeat)
    rows = [("large pinned copy", f"{args.limit_mib} MiB", "copy engine", bandwidth["store"], bandwidth["load"])]
    for shape, block in SHAPES.items():
        host = torch.empty((args.blocks, block.nbytes), dtype=torch.uint8, pin_memory=True)
        for cross_layer, layout in ((True, "cross-layer"), (False, "per-layer")):
            for method in ("copy_engine", "kernel"):
                store, load = bench_path(block, cross_layer, method, args.blocks, host, args.repeat)
                torch.cuda.empty_cache()
                label = {"copy_engine": "cudaMemcpyAsync per block" if cross_layer else "cudaMemcpyAsync per piece",
                         "kernel": "copy kernel" if cross_layer else "pack/unpack kernel"}[method]
                rows.append((shape, layout, label, store, load))
        del host
    print(f"\n| {'shape':<22} | {'layout':<11} | {'path':<27} | {'D2H GB/s':>8} | {'% limit':>7} "
          f"| {'H2D GB/s':>8} | {'% limit':>7} |")
    print(f"|{'-' * 24}|{'-' * 13}|{'-' * 29}|{'-' * 10}|{'-' * 9}|{'-' * 10}|{'-' * 9}|")
    for shape, layout, path, store, load in rows:
        print(f"| {shape:<22} | {layout:<11} | {path:<27} | {store:8.1f} | {100 * store / bandwidth['store']:6.1f}% "
              f"| {load:8.1f} | {100 * load / bandwidth['load']:6.1f}% |")
    print("\nall paths verified bit for bit against kvtier.kernels.fallback")


if __name__ == "__main__":
    main()
