"""GPU ↔ pinned host transfer benchmark: cross-layer vs per-layer, kernel vs copy engine (issue 5).

The limit is one large pinned H2D and D2H copy measured in the same run. Then, for a Llama-3.1-8B
block (32 layers × 8 KV heads × 128 dim × 16 tokens, fp16: 2 MiB cross-layer) and a TP=8 70B block
(80 layers × 1 head: 640 KiB), ``--blocks`` random engine blocks are stored (device → pinned host)
and loaded back (host → device) four ways: cross-layer cache via the copy engine (one
cudaMemcpyAsync per block) and via the copy kernel; per-layer cache via one cudaMemcpyAsync per
(layer, K|V) piece (the old way) and via the pack/unpack kernel. A crossover sweep then times the
copy kernel against the copy engine for cross-layer blocks from 4 KiB to 2 MiB, at 64 and
``--blocks`` blocks per call, which gives the ``transfer.crossover`` to configure. Every result is
checked bit for bit against ``kvtier.kernels.fallback``. Times are wall clock from enqueue to
completion (Python launch overhead included, since the engine pays it too), best of ``--repeat``.

Prints the tables and the issue's three targets (cross-layer ≥ 90 % of the limit; pack kernel ≥ 4×
the per-piece copy loop; kernel faster than the copy engine for blocks under 64 KiB), and writes
them with the command to ``--out`` (``gpu_<device>.md`` and ``.json``). Takes about a minute on an
H200 with the defaults.

Usage: python benchmarks/bench_gpu.py [--blocks 1024] [--repeat 3] [--limit-mib 1024]
                                      [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.detect import make_cross_layer_kv
from kvtier.kernels import fallback
from kvtier.layout import BlockLayout, PerLayerKind, PerLayerLayout

SHAPES = {
    "llama-3.1-8b (2 MiB)": BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16),
    "70b tp=8 (640 KiB)": BlockLayout(num_layers=80, num_kv_heads=1, head_dim=128, block_size=16),
}
PER_LAYER = PerLayerLayout(PerLayerKind.FLASH_ATTN, "NHD")
#: Cross-layer block sizes of the crossover sweep, and the block counts per call.
SWEEP_BYTES = (4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)
SWEEP_SMALL_COUNT = 64
SMALL_BLOCK_BYTES = 64 << 10


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

    copy(host, device)()  # warm-up: first touch of the pinned pages
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
               repeat: int, slab: bool = False) -> tuple[float, float]:
    """(store GB/s, load GB/s) of one EngineKV path, both verified against the fallback.

    Slots are ``num_blocks`` 1-D views of ``host``'s rows, or with ``slab`` the whole ``host`` and a
    random permutation of row ids (what a CPU tier's scattered slots look like)."""
    from kvtier.tiers.gpu import EngineKV, TransferChoice

    engine_blocks = num_blocks + num_blocks // 8
    layers = random_kv(block, engine_blocks, cross_layer)
    engine = EngineKV(layers, block_size=block.block_size, num_kv_heads=block.num_kv_heads,
                      head_dim=block.head_dim, transfer=TransferChoice(method))  # type: ignore[arg-type]
    assert engine.detected.cross_layer is cross_layer
    slot_rows = torch.randperm(num_blocks) if slab else None
    slots: torch.Tensor | list[torch.Tensor] = host if slab else list(host[:num_blocks])
    ids = torch.randperm(engine_blocks)[:num_blocks]
    nbytes = num_blocks * block.nbytes
    what = f"{method} ({'cross-layer' if cross_layer else 'per-layer'}, {block.describe()})"

    engine.store(ids, slots, slot_rows).wait()  # warm-up: compiles the kernels
    store = nbytes / timed(lambda: engine.store(ids, slots, slot_rows).wait(), repeat) / 1e9
    expected = torch.empty((num_blocks, *block.shape), dtype=block.dtype, device="cuda")
    fallback.pack_blocks(layers, ids, PER_LAYER, block, expected)
    stored = host[slot_rows] if slot_rows is not None else host[:num_blocks]
    if not torch.equal(stored.cuda(), expected.view(torch.uint8).view(num_blocks, -1)):
        raise SystemExit(f"store via {what} differs from the fallback")

    load_ids = torch.randperm(engine_blocks)[:num_blocks]
    reference = [layer.clone() for layer in layers]
    fallback.unpack_blocks(expected, reference, load_ids, PER_LAYER, block)
    load = nbytes / timed(lambda: engine.load(slots, load_ids, slot_rows).wait(), repeat) / 1e9
    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(layers, reference, strict=True)):
        raise SystemExit(f"load via {what} differs from the fallback")
    return store, load


def sweep_point(block_bytes: int, count: int, repeat: int) -> dict[str, float]:
    """GB/s of the copy kernel and the copy engine for ``count`` random blocks of ``block_bytes`` each way."""
    from kvtier.kernels import copy_engine, cuda

    engine_blocks = count + count // 8
    device = torch.randint(0, 256, (engine_blocks, block_bytes), dtype=torch.uint8, device="cuda")
    host = torch.zeros((count, block_bytes), dtype=torch.uint8, pin_memory=True)
    ids = torch.randperm(engine_blocks)[:count]
    device_ids, host_ids = ids.cuda(), torch.arange(count)
    stream = torch.cuda.Stream()

    def transfer(method: str, store: bool) -> Callable[[], None]:
        def run() -> None:
            if method == "kernel" and store:
                cuda.copy_blocks(device, ids, host, host_ids, stream=stream)
            elif method == "kernel":
                cuda.copy_blocks(host, host_ids, device, ids, stream=stream)
            else:  # the addresses are listed per call, as an engine would
                device_rows = [device.data_ptr() + int(b) * block_bytes for b in ids.tolist()]
                host_rows = [host.data_ptr() + i * block_bytes for i in range(count)]
                dst, src = (host_rows, device_rows) if store else (device_rows, host_rows)
                copy_engine.memcpy_async(copy_engine.coalesce(dst, src, block_bytes), device.device, stream)
            stream.synchronize()
        return run

    result: dict[str, float] = {}
    for method in ("kernel", "copy_engine"):
        host.zero_()
        run = transfer(method, store=True)
        run()  # warm-up (and the kernel's first compile)
        result[f"{method}_store"] = count * block_bytes / timed(run, repeat) / 1e9
        if not torch.equal(host.cuda(), device.index_select(0, device_ids)):
            raise SystemExit(f"store of {count} x {block_bytes} B via {method} differs from the reference")
        fresh = torch.randint(0, 256, host.shape, dtype=torch.uint8, device="cuda")
        host.copy_(fresh)
        run = transfer(method, store=False)
        run()
        result[f"{method}_load"] = count * block_bytes / timed(run, repeat) / 1e9
        if not torch.equal(device.index_select(0, device_ids), fresh):
            raise SystemExit(f"load of {count} x {block_bytes} B via {method} differs from the reference")
    return result


def measured_crossover(sweep: list[dict[str, Any]], count: int) -> int | None:
    """Smallest swept block size from which the copy engine is at least as fast as the kernel both ways."""
    rows = sorted((row for row in sweep if row["count"] == count), key=lambda row: row["block_bytes"])
    for index, row in enumerate(rows):
        if all(later["copy_engine_store"] >= later["kernel_store"]
               and later["copy_engine_load"] >= later["kernel_load"] for later in rows[index:]):
            return int(row["block_bytes"])
    return None


def views_rows(paths: list[dict[str, Any]], shape: str) -> dict[tuple[str, str], dict[str, Any]]:
    """``shape``'s paths with slot views (like for like with the per-piece loop), by (layout, method)."""
    return {(row["layout"], row["method"]): row for row in paths
            if row.get("shape") == shape and row.get("slots", "views") == "views"}


def best_cross_layer(paths: list[dict[str, Any]], shape: str, direction: str) -> float:
    """The fastest cross-layer path of ``shape`` in ``direction``, whatever its method or slot form."""
    return max(row[direction] for row in paths
               if row.get("shape") == shape and row["layout"] == "cross-layer")


def kib(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


def report(header: list[str], bandwidth: dict[str, float], paths: list[dict[str, Any]],
           sweep: list[dict[str, Any]],
           blocks: int) -> tuple[list[str], list[tuple[str, bool, str]], int | None]:
    """The tables, the issue's targets ``(name, met, measured)`` and the measured crossover, from the
    numbers."""
    from kvtier.tiers.gpu import DEFAULT_CROSSOVER_BYTES

    crossover = measured_crossover(sweep, blocks)
    lines = [*header, "", f"| {'shape':<22} | {'layout':<11} | {'path':<36} | {'D2H GB/s':>8} "
             f"| {'% limit':>7} | {'H2D GB/s':>8} | {'% limit':>7} |",
             f"|{'-' * 24}|{'-' * 13}|{'-' * 38}|{'-' * 10}|{'-' * 9}|{'-' * 10}|{'-' * 9}|"]
    for row in paths:
        lines.append(f"| {row['shape']:<22} | {row['layout']:<11} | {row['path']:<36} | {row['store']:8.1f} "
                     f"| {100 * row['store'] / bandwidth['store']:6.1f}% | {row['load']:8.1f} "
                     f"| {100 * row['load'] / bandwidth['load']:6.1f}% |")
    lines += ["", "Cross-layer blocks (best cross-layer path) over per-layer pages moved one "
                  "cudaMemcpyAsync per (layer, K|V) piece (vLLM's per-layer way), and over the pack kernel:",
              ""]
    for shape in SHAPES:
        rows = views_rows(paths, shape)
        if len(rows) < 4:
            continue
        ratios = []
        for direction, name in (("store", "D2H"), ("load", "H2D")):
            best = best_cross_layer(paths, shape, direction)
            per_piece = best / rows[("per-layer", "copy_engine")][direction]
            packed = best / rows[("per-layer", "kernel")][direction]
            ratios.append(f"{name} {per_piece:.1f}x the per-piece loop, {packed:.2f}x the pack kernel")
        lines.append(f"- {shape}: " + "; ".join(ratios))
    lines += ["", "Crossover sweep: cross-layer blocks, copy kernel vs copy engine "
                  "(one cudaMemcpyAsync per block), GB/s",
              "", "| block | blocks/call | kernel D2H | engine D2H | kernel H2D | engine H2D |",
              "|------:|------------:|-----------:|-----------:|-----------:|-----------:|"]
    for row in sweep:
        lines.append(f"| {kib(row['block_bytes'])} | {row['count']} | {row['kernel_store']:.1f} "
                     f"| {row['copy_engine_store']:.1f} | {row['kernel_load']:.1f} "
                     f"| {row['copy_engine_load']:.1f} |")
    lines += ["", f"measured crossover at {blocks} blocks/call: "
              + (f"{kib(crossover)} (configure `transfer: {{crossover: {kib(crossover).replace(' ', '')}}}`; "
                 f"built-in default {kib(DEFAULT_CROSSOVER_BYTES)})" if crossover is not None
                 else "none in the sweep: the kernel is as fast or faster at every size")]

    targets: list[tuple[str, bool, str]] = []
    for shape in SHAPES:
        rows = views_rows(paths, shape)
        for direction, name in (("store", "D2H"), ("load", "H2D")):
            best = best_cross_layer(paths, shape, direction)
            share = best / bandwidth[direction]
            targets.append((f"{shape} cross-layer {name} ≥ 90% of the limit", share >= 0.9,
                            f"{100 * share:.1f}%"))
            speedup = rows[("per-layer", "kernel")][direction] / rows[("per-layer", "copy_engine")][direction]
            targets.append((f"{shape} pack kernel {name} ≥ 4x the per-piece copy loop", speedup >= 4,
                            f"{speedup:.1f}x"))
    small = [row for row in sweep if row["block_bytes"] < SMALL_BLOCK_BYTES]
    for direction, name in (("store", "D2H"), ("load", "H2D")):
        worst = min(row[f"kernel_{direction}"] / row[f"copy_engine_{direction}"] for row in small)
        targets.append((f"blocks < 64 KiB: kernel beats the copy engine {name}", worst > 1,
                        f"worst {worst:.2f}x"))
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if met else 'NO'} | {value} |" for name, met, value in targets]
    return lines, targets, crossover


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved each way per path")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    parser.add_argument("--limit-mib", type=int, default=1024, help="size of the large reference copy")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="folder for gpu_<device>.md and gpu_<device>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device (torch.cuda.is_available() is False); "
                         "run it on a GPU machine")
    from kvtier.kernels.cuda import require_cuda

    cupy = require_cuda()
    started = time.perf_counter()
    command = shlex.join(["python", *sys.argv])
    device_name = torch.cuda.get_device_name()
    header = [f"# {command}",
              f"# {device_name}, torch {torch.__version__}, CuPy {cupy.__version__}, CUDA runtime "
              f"{torch.version.cuda}, {platform.node()}; {args.blocks} blocks each way, "
              f"best of {args.repeat}"]
    print("\n".join(header), flush=True)

    bandwidth = limit(args.limit_mib << 20, args.repeat)
    failures: list[str] = []
    paths: list[dict[str, Any]] = [{"shape": "large pinned copy", "layout": f"{args.limit_mib} MiB",
                                    "path": "copy engine", "store": bandwidth["store"],
                                    "load": bandwidth["load"]}]
    for shape, block in SHAPES.items():
        host = torch.empty((args.blocks, block.nbytes), dtype=torch.uint8, pin_memory=True)
        for cross_layer, layout in ((True, "cross-layer"), (False, "per-layer")):
            for method, slab in (("copy_engine", False), ("kernel", False), ("kernel", True)):
                try:
                    store, load = bench_path(block, cross_layer, method, args.blocks, host, args.repeat, slab)
                except (Exception, SystemExit) as error:  # one GPU run: report the rest, fail at the end
                    failures.append(f"{shape} {layout} {method}: {error}")
                    print(f"  FAILED {failures[-1]}", flush=True)
                    store = load = float("nan")
                torch.cuda.empty_cache()
                label = {"copy_engine": ("cudaMemcpyAsync per block" if cross_layer
                                         else "cudaMemcpyAsync per piece"),
                         "kernel": "copy kernel" if cross_layer else "pack/unpack kernel"}[method]
                label += ", slab + slot ids" if slab else ""
                paths.append({"shape": shape, "layout": layout, "path": label, "method": method,
                              "slots": "slab" if slab else "views", "block_bytes": block.nbytes,
                              "store": store, "load": load})
                print(f"  {shape:<22} {layout:<11} {label:<36} D2H {store:6.1f} GB/s  H2D {load:6.1f} GB/s",
                      flush=True)
        del host

    sweep: list[dict[str, Any]] = []
    for count in (SWEEP_SMALL_COUNT, args.blocks):
        for block_bytes in SWEEP_BYTES:
            try:
                point = sweep_point(block_bytes, count, args.repeat)
            except (Exception, SystemExit) as error:
                failures.append(f"sweep {kib(block_bytes)} x {count}: {error}")
                print(f"  FAILED {failures[-1]}", flush=True)
                point = {f"{method}_{direction}": float("nan") for method in ("kernel", "copy_engine")
                         for direction in ("store", "load")}
            sweep.append({"block_bytes": block_bytes, "count": count, **point})
            torch.cuda.empty_cache()
        print(f"  crossover sweep at {count} blocks/call done", flush=True)

    lines, targets, crossover = report(header, bandwidth, paths, sweep, args.blocks)
    lines += ["", (f"FAILED: {'; '.join(failures)}" if failures else
                   "all paths verified bit for bit against kvtier.kernels.fallback")
              + f"; {time.perf_counter() - started:.0f} s"]
    print("\n" + "\n".join(lines[len(header):]))
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    (args.out / f"gpu_{slug}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"gpu_{slug}.json").write_text(json.dumps({
        "command": command, "device": device_name, "torch": torch.__version__, "cupy": cupy.__version__,
        "blocks": args.blocks, "repeat": args.repeat, "limit_gbps": bandwidth, "paths": paths, "sweep": sweep,
        "crossover_bytes": crossover,
        "targets": [{"target": n, "met": m, "measured": v} for n, m, v in targets],
    }, indent=1) + "\n")
    print(f"wrote {args.out / f'gpu_{slug}.md'} and .json")
    if failures:
        raise SystemExit(f"bench_gpu: {len(failures)} path(s) failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
