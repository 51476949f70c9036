"""Throughput of the file tier (and the CPU tier, and TieredCache over it) next to raw I/O / memcpy.

Not a test: it prints one table per block size, with every baseline measured in the same run, and
the command line that made it. Block sizes (``--block-kib``, default ``256,2048``): 2 MiB is the
cross-layer block of Llama-3.1-8B (32 layers × K,V × 16 tokens × 8 KV heads × 128 dims, fp16);
256 KiB is its tensor-parallel-8 shard (one KV head per rank), the small-block case (TP shards, MLA
latents) where per-block costs show. Every size moves the same bytes (``--mib``).

- File tier ``put`` vs raw ``open(O_DIRECT) + pwritev([header page, block]) + close`` per block (one
  file per block, no temp + rename, no checksum), from page-aligned buffers; 1 thread and a pool.
- File tier ``get`` vs raw ``open + preadv([header page, block]) + close`` into page-aligned buffers,
  warm (files in the page cache) and cold (after ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``;
  needs root, else reported as n/a), buffered, plus ``O_DIRECT`` cold reads (``direct_reads=True``).
  Warm reads also get a second baseline, raw ``preadv`` + one xxh3 pass over the block: the checksum
  every tier read must verify, which plain ``preadv`` does not pay.
- CPU tier ``put``/``get`` vs ``np.copyto`` of the same blocks into / out of a page-aligned slab, and
  ``TieredCache.store``/``load`` over one full CPU tier (the steady state: every store evicts) vs the
  same ``np.copyto``.

Usage: ``python benchmarks/bench_tiers.py [--block-kib 256,2048] [--mib 1024] [--dir DIR] [--threads 4]
[--batch 64]``.
DIR must be on the disk under test (not tmpfs); the default is a fresh directory under the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvtier import TieredCache
from kvtier.blocks import BlockKey
from kvtier.layout import BlockLayout
from kvtier.tiers.buffers import aligned_empty
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.file import PAGE, FileTier

TARGET_FILE = 0.80
TARGET_CPU = 0.70
TARGET_CACHE_CPU = 0.90


def kv_layout(block_kib: int) -> BlockLayout:
    """Llama-3.1-8B's cross-layer block (32 layers, 16 tokens, head_dim 128, fp16) with as many KV heads
    as make ``block_kib``: 8 heads = 2 MiB (TP-1), 1 head = 256 KiB (TP-8); below that, a narrower head."""
    per_head = 32 * 2 * 16 * 128 * 2 // 1024  # KiB of one KV head
    if block_kib % per_head == 0:
        return BlockLayout(num_layers=32, num_kv_heads=block_kib // per_head, head_dim=128, block_size=16,
                           dtype=torch.float16)
    if block_kib % 4 or (block_kib * 1024) % (32 * 2 * 16 * 2):
        raise SystemExit(f"--block-kib {block_kib}: use a multiple of 4 KiB that is a whole number of heads")
    return BlockLayout(num_layers=32, num_kv_heads=1, head_dim=block_kib * 1024 // (32 * 2 * 16 * 2),
                       block_size=16, dtype=torch.float16)


class Row:
    def __init__(self, operation: str, threads: str, cache: str, ours: float | None, baseline_name: str,
                 baseline: float | None, target: float | None = None) -> None:
        self.cells = [operation, threads, cache, _fmt(ours), baseline_name, _fmt(baseline)]
        ratio = ours / baseline if ours is not None and baseline else None
        self.cells.append("n/a" if ratio is None else f"{ratio:.0%}")
        if target is None or ratio is None:
            self.cells.append("")
        else:
            self.cells.append(f"≥{target:.0%} {'met' if ratio >= target else 'MISSED'}")


def _fmt(gbps: float | None) -> str:
    return "n/a" if gbps is None else f"{gbps:.2f}"


def print_table(rows: list[Row]) -> None:
    head = ["operation", "threads", "page cache", "kvtier GB/s", "baseline", "baseline GB/s", "ratio",
            "target"]
    table = [head, *(row.cells for row in rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(head))]
    for n, cells in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def filesystem_of(path: Path) -> str:
    best, fs, dev = "", "?", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount, kind = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, fs, dev = mount, kind, device
    return f"{fs} on {dev} (mounted at {best})"


def timed(nbytes: int, fn: Callable[..., object], *args: object) -> float:
    """GB/s of moving ``nbytes`` with ``fn(*args)``."""
    start = time.perf_counter()
    fn(*args)
    return nbytes / (time.perf_counter() - start) / 1e9


def in_pool(threads: int, count: int, fn: Callable[[int], object]) -> None:
    if threads == 1:
        for i in range(count):
            fn(i)
        return
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(fn, range(count)):
            pass


class Blocks:
    """``n`` keys over a rotating set of page-aligned, pre-touched source and destination blocks."""

    def __init__(self, n: int, pool_size: int, nbytes: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.sources = [aligned_empty(nbytes).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                                                  generator=gen)) for _ in range(pool_size)]
        self.outs = [aligned_empty(nbytes).zero_() for _ in range(pool_size)]
        self.keys = [BlockKey(i.to_bytes(8, "big") * 2, 0) for i in range(n)]

    def source(self, i: int) -> torch.Tensor:
        return self.sources[i % len(self.sources)]

    def out(self, i: int) -> torch.Tensor:
        return self.outs[i % len(self.outs)]

    def batches(self, size: int) -> list[tuple[list[BlockKey], list[int]]]:
        return [(self.keys[s:s + size], list(range(s, min(s + size, len(self.keys)))))
                for s in range(0, len(self.keys), size)]


class RawFiles:
    """The baseline: one file per block, header page + block with one pwritev/preadv, no tier logic."""

    def __init__(self, directory: Path, blocks: Blocks, threads: int) -> None:
        self.directory = directory
        self.blocks = blocks
        self.headers = [aligned_empty(PAGE).zero_().numpy() for _ in range(max(threads, 1) * 2)]

    def reset(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(mode=0o700)

    def write(self, i: int) -> None:
        fd = os.open(self.directory / f"{i}.blk", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [self.headers[0].data, self.blocks.source(i).numpy().data], 0)
        finally:
            os.close(fd)

    def read(self, i: int, direct: bool, checksum: bool = False) -> None:
        fd = os.open(self.directory / f"{i}.blk", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            os.preadv(fd, [self.headers[i % len(self.headers)].data, self.blocks.out(i).numpy().data], 0)
        finally:
            os.close(fd)
        if checksum:  # the codec's checksum pass, the floor every tier read pays (docs/file-tier.md)
            xxhash.xxh3_64_intdigest(self.blocks.out(i).numpy().data)


def bench_file(args: argparse.Namespace, layout: BlockLayout, root: Path, rows: list[Row],
               notes: list[str]) -> None:
    n, threads_n = args.mib * (1 << 20) // layout.nbytes, args.threads
    total = n * layout.nbytes
    blocks = Blocks(n, min(args.batch, n), layout.nbytes)
    batches = blocks.batches(args.batch)
    raw = RawFiles(root / "raw", blocks, threads_n)
    namespace = "tier"

    def tier(threads: int, direct_reads: bool = False) -> FileTier:
        return FileTier("bench", {0: layout}, {0: total}, root=root, namespace=namespace,
                        io_threads=threads, direct_reads=direct_reads)

    async def put_all(t: FileTier) -> None:
        for keys, idx in batches:
            assert all(await t.put(keys, [blocks.source(i) for i in idx])), t.counters.errors

    async def get_all(t: FileTier) -> None:
        for keys, idx in batches:
            assert all(await t.get(keys, [blocks.out(i) for i in idx])), t.counters.errors

    def raw_put(threads: int) -> float:
        raw.reset()
        drop_caches()
        return timed(total, in_pool, threads, n, raw.write)

    def tier_put(threads: int) -> float:
        shutil.rmtree(root / namespace, ignore_errors=True)
        t = tier(threads)
        if t.write_io_active != t.write_io and "O_DIRECT" not in " ".join(notes):
            notes.append("O_DIRECT is not supported here: the file tier fell back to synced buffered writes")
        drop_caches()
        gbps = timed(total, asyncio.run, put_all(t))
        asyncio.run(t.close())
        return gbps

    best = interleaved(args.repeat, {
        (1, "raw"): lambda: raw_put(1), (1, "tier"): lambda: tier_put(1),
        (threads_n, "raw"): lambda: raw_put(threads_n), (threads_n, "tier"): lambda: tier_put(threads_n)})
    for threads in (1, threads_n):
        rows.append(Row("file put", str(threads), "-", best[threads, "tier"], "raw O_DIRECT pwritev",
                        best[threads, "raw"], TARGET_FILE if threads > 1 else None))

    readers = {1: tier(1), threads_n: tier(threads_n), "direct": tier(threads_n, direct_reads=True)}
    assert all(len(list(r.keys())) == n for r in readers.values())

    def cold(fn: Callable[..., object], *fn_args: object) -> Callable[[], float]:
        def measure() -> float:
            drop_caches()
            return timed(total, fn, *fn_args)
        return measure

    if drop_caches():
        best = interleaved(args.repeat, {
            (1, "raw"): cold(in_pool, 1, n, lambda i: raw.read(i, False)),
            (1, "tier"): cold(lambda: asyncio.run(get_all(readers[1]))),
            (threads_n, "raw"): cold(in_pool, threads_n, n, lambda i: raw.read(i, False)),
            (threads_n, "tier"): cold(lambda: asyncio.run(get_all(readers[threads_n]))),
            ("direct", "raw"): cold(in_pool, threads_n, n, lambda i: raw.read(i, True)),
            ("direct", "tier"): cold(lambda: asyncio.run(get_all(readers["direct"])))})
        for threads in (1, threads_n):
            rows.append(Row("file get", str(threads), "cold", best[threads, "tier"], "raw preadv",
                            best[threads, "raw"], TARGET_FILE if threads > 1 else None))
        rows.append(Row("file get direct_reads", str(threads_n), "cold", best["direct", "tier"],
                        "raw O_DIRECT preadv", best["direct", "raw"], TARGET_FILE))
    else:
        notes.append("cold: n/a (cannot drop caches)")

    in_pool(threads_n, n, lambda i: raw.read(i, False))  # both file sets into the page cache
    asyncio.run(get_all(readers[threads_n]))
    best = interleaved(args.repeat, {
        (1, "raw"): lambda: timed(total, in_pool, 1, n, lambda i: raw.read(i, False)),
        (1, "raw+xxh3"): lambda: timed(total, in_pool, 1, n, lambda i: raw.read(i, False, checksum=True)),
        (1, "tier"): lambda: timed(total, lambda: asyncio.run(get_all(readers[1]))),
        (threads_n, "raw"): lambda: timed(total, in_pool, threads_n, n, lambda i: raw.read(i, False)),
        (threads_n, "raw+xxh3"): lambda: timed(total, in_pool, threads_n, n,
                                               lambda i: raw.read(i, False, checksum=True)),
        (threads_n, "tier"): lambda: timed(total, lambda: asyncio.run(get_all(readers[threads_n])))})
    for threads in (1, threads_n):
        rows.append(Row("file get", str(threads), "warm", best[threads, "tier"], "raw preadv",
                        best[threads, "raw"], TARGET_FILE if threads > 1 else None))
        rows.append(Row("file get", str(threads), "warm", best[threads, "tier"], "raw preadv + xxh3",
                        best[threads, "raw+xxh3"]))

    assert all(torch.equal(blocks.out(i), blocks.source(i)) for i in range(len(blocks.outs)))
    errors = {k: v for r in readers.values() for k, v in r.counters.errors.items()}
    if errors:
        notes.append(f"file tier errors: {errors}")
    for reader in readers.values():
        asyncio.run(reader.close())


def interleaved(repeat: int, measurements: dict[object, Callable[[], float]]) -> dict[object, float]:
    """Run every measurement ``repeat`` times, round-robin, and keep each one's best GB/s."""
    best: dict[object, float] = {}
    for _ in range(repeat):
        for name, measure in measurements.items():
            best[name] = max(best.get(name, 0.0), measure())
    return best


def bench_cpu(args: argparse.Namespace, layout: BlockLayout, rows: list[Row]) -> None:
    n = args.mib * (1 << 20) // layout.nbytes
    total = n * layout.nbytes
    blocks = Blocks(n, min(args.batch, n), layout.nbytes)
    batches = blocks.batches(args.batch)
    tier = CpuTier("bench", {0: layout}, {0: total}, pinned=False)
    slab = aligned_empty(total).view(n, layout.nbytes).numpy()
    cache, cache_keys = full_cpu_cache(layout, n)
    shape = layout.shape
    sources = [blocks.source(i).view(torch.float16).view(shape) for i in range(len(blocks.sources))]
    outs = [blocks.out(i).view(torch.float16).view(shape) for i in range(len(blocks.outs))]

    key_sets = {"resident": cache_keys, "spare": blocks.keys}  # the cache holds exactly one set

    def cache_store() -> None:  # stores the set it does not hold: every block evicts one of the other set
        spare = key_sets["spare"]
        for _, idx in batches:
            keys = [spare[i] for i in idx]
            assert cache.store(keys, [sources[i % len(sources)] for i in idx]) == len(keys), cache.stats()
        key_sets["resident"], key_sets["spare"] = spare, key_sets["resident"]

    def cache_load() -> None:
        resident = key_sets["resident"]
        for _, idx in batches:
            keys = [resident[i] for i in idx]
            assert cache.load(keys, [outs[i % len(outs)] for i in idx]) == len(keys), cache.stats()

    async def put_all() -> None:
        for keys, idx in batches:
            assert all(await tier.put(keys, [blocks.source(i) for i in idx]))

    async def get_all() -> None:
        for keys, idx in batches:
            assert all(await tier.get(keys, [blocks.out(i) for i in idx]))

    def copy_in() -> None:
        for i in range(n):
            np.copyto(slab[i], blocks.source(i).numpy())

    def copy_out() -> None:
        for i in range(n):
            np.copyto(blocks.out(i).numpy(), slab[i])

    asyncio.run(put_all())  # first touch of every page, for the tier and the baseline alike
    copy_in()
    for keys, idx in batches:  # the cache's slab too: filled with other keys, so every timed store evicts
        assert cache.store([cache_keys[i] for i in idx],
                           [sources[i % len(sources)] for i in idx]) == len(keys)
    best = interleaved(args.repeat, {
        "put": lambda: timed(total, lambda: asyncio.run(put_all())),
        "in": lambda: timed(total, copy_in),
        "get": lambda: timed(total, lambda: asyncio.run(get_all())),
        "out": lambda: timed(total, copy_out),
        "store": lambda: timed(total, cache_store),
        "load": lambda: timed(total, cache_load)})
    rows.append(Row("cpu put", "1", "-", best["put"], "np.copyto into slab", best["in"]))
    rows.append(Row("cpu get", "1", "-", best["get"], "np.copyto out of slab", best["out"]))
    round_trip = 2 / (1 / best["put"] + 1 / best["get"])
    rows.append(Row("cpu round trip", "1", "-", round_trip, "np.copyto in + out",
                    2 / (1 / best["in"] + 1 / best["out"]), TARGET_CPU))
    rows.append(Row("cache store (cpu, full)", "1", "-", best["store"], "np.copyto into slab", best["in"],
                    TARGET_CACHE_CPU))
    rows.append(Row("cache load (cpu)", "1", "-", best["load"], "np.copyto out of slab", best["out"],
                    TARGET_CACHE_CPU))
    cache.close()
    asyncio.run(tier.close())


def full_cpu_cache(layout: BlockLayout, n: int) -> tuple[TieredCache, list[BlockKey]]:
    """TieredCache with one CPU tier of exactly ``n`` blocks, and ``n`` keys other than the benchmark's.

    LRU, so that storing one key set evicts exactly the other (the default policy may keep some of
    the older set, and a load of the newer one would then stop at the first block it dropped)."""
    cache = TieredCache.from_config({
        "model": {"name": "bench", "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                  "head_dim": layout.head_dim, "dtype": "float16"},
        "hash_block_size": layout.block_size,
        "tiers": [{"type": "cpu", "capacity": n * layout.nbytes, "pinned": False, "eviction": "lru"}]})
    return cache, [BlockKey(b"w" * 8 + i.to_bytes(8, "big"), 0) for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", default="256,2048",
                        help="block sizes in KiB, comma separated; one table each (default 256,2048)")
    parser.add_argument("--mib", type=int, default=1024, help="MiB moved per measurement (default 1024)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the disk under test (default: ./)")
    parser.add_argument("--threads", type=int, default=4, help="I/O threads of the pooled runs (default 4)")
    parser.add_argument("--batch", type=int, default=64, help="blocks per put/get call (default 64)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of each measurement; the best is shown (default 5)")
    args = parser.parse_args(argv)

    parent = args.dir or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=parent))
    layouts = [kv_layout(int(kib)) for kib in args.block_kib.split(",")]
    print(f"$ python {shlex.join(sys.argv)}")
    print(f"dir {root.parent}: {filesystem_of(root.parent)}; {os.cpu_count()} CPUs; "
          f"load {os.getloadavg()[0]:.2f}; "
          f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}")
    try:
        for layout in layouts:
            rows: list[Row] = []
            notes: list[str] = []
            start = time.perf_counter()
            bench_file(args, layout, root, rows, notes)
            bench_cpu(args, layout, rows)
            print()
            print(f"kvtier tier throughput: {args.mib * (1 << 20) // layout.nbytes} blocks of "
                  f"{layout.nbytes >> 10} KiB ({layout.describe()}), {args.batch} blocks per call, "
                  f"best of {args.repeat} interleaved runs")
            print()
            print_table(rows)
            for note in notes:
                print(f"note: {note}")
            print(f"(took {time.perf_counter() - start:.0f}s; load {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
