"""CPU time of a warm file-tier read, per block: the figure that survives a busy machine.

Not a test. Writes ``--blocks`` blocks with a default ``FileTier`` (``write_io: synced``, so they
stay in the page cache), then reads them all back the way the peer harness does: one ``get`` per
batch of ``--batch``, every batch in flight at once (``asyncio.gather``). Each round prints the
process CPU time per block (every thread: the I/O threads' copies and checksums and the event
loop's share) and the wall-clock rate; the last line gives the medians. On a shared machine the
wall-clock rate moves with the neighbours, the CPU time much less: compare two trees by running
this script with each tree on ``PYTHONPATH``, alternating, and comparing the CPU medians.

``--raw`` adds two baselines in the same rounds, on the same files and buffers: ``raw``, plain
``open`` + one ``os.preadv`` into [header page, block] + ``close`` on ``--io-threads`` threads (what
the peer harness's ``raw_file`` row does, there on one thread), and ``raw+xxh3``, the same plus the
block's xxh3-64 (the least a checked read costs from Python).

Usage: ``PYTHONPATH=<tree> python benchmarks/bench_file_read_cpu.py [--block-kib 256]
[--blocks 1024] [--batch 32] [--rounds 5] [--io-threads 4] [--raw] [--dir DIR]``. DIR must be on the disk
under test (not tmpfs); it is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

import kvtier
from kvtier.blocks import BlockKey
from kvtier.layout import BlockLayout
from kvtier.tiers.file import FileTier

_LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # K and V of 16 tokens, 8 KV heads of 128 dims, fp16: 64 KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", type=int, default=256, help="block size, a multiple of 64")
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--raw", action="store_true", help="also time raw preadv (and preadv + xxh3) reads")
    parser.add_argument("--dir", default=None, help="parent directory of the data (default: system temp)")
    args = parser.parse_args()
    size = args.block_kib * 1024
    if size % _LAYER_BYTES:
        parser.error("--block-kib must be a multiple of 64")
    layout = BlockLayout(num_layers=size // _LAYER_BYTES, num_kv_heads=8, head_dim=128, block_size=16,
                         dtype=torch.float16)
    n = args.blocks
    source = mmap.mmap(-1, n * size)  # page-aligned, like the harness's buffers
    flat_src = torch.frombuffer(source, dtype=torch.uint8)
    flat_src.copy_(torch.randint(0, 256, (n * size,), dtype=torch.uint8))
    dest = mmap.mmap(-1, n * size)
    flat_dst = torch.frombuffer(dest, dtype=torch.uint8)
    src = [flat_src[i * size:(i + 1) * size] for i in range(n)]
    out = [flat_dst[i * size:(i + 1) * size] for i in range(n)]
    keys = [BlockKey(b"r" * 8 + i.to_bytes(8, "big"), 0) for i in range(n)]
    spans = [(s, min(n, s + args.batch)) for s in range(0, n, args.batch)]
    root = tempfile.mkdtemp(prefix="kvtier-read-cpu-", dir=args.dir)
    loop = asyncio.new_event_loop()
    tier = FileTier("bench", {0: layout}, {0: 2 * n * size}, root=root, namespace="bench",
                    io_threads=args.io_threads)
    try:
        async def put() -> list[list[bool]]:
            return await asyncio.gather(*[tier.put(keys[a:z], src[a:z]) for a, z in spans])

        async def get() -> list[list[bool]]:
            return await asyncio.gather(*[tier.get(keys[a:z], out[a:z]) for a, z in spans])

        if not all(all(r) for r in loop.run_until_complete(put())):
            raise SystemExit(f"puts failed: {tier.counters.errors}")
        print(f"kvtier from {os.path.dirname(kvtier.__file__)}; {n} x {args.block_kib} KiB, batches of "
              f"{args.batch}, io_threads {args.io_threads}, write_io {tier.write_io_active}")
        paths = [str(tier.path_of(key)) for key in keys]
        pool = ThreadPoolExecutor(args.io_threads)
        pages = [memoryview(mmap.mmap(-1, 4096)) for _ in range(args.io_threads)]
        views = [memoryview(block.numpy()) for block in out]

        def raw_reads(part: int, checksum: bool) -> None:
            page = pages[part]
            for i in range(part, n, args.io_threads):
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    os.preadv(fd, [page, views[i]], 0)
                finally:
                    os.close(fd)
                if checksum:
                    xxhash.xxh3_64(views[i]).intdigest()

        def raw(checksum: bool) -> None:
            list(pool.map(raw_reads, range(args.io_threads), [checksum] * args.io_threads))

        cases = {"kvtier get": lambda: loop.run_until_complete(get())}
        if args.raw:
            cases["raw"] = lambda: raw(False)
            cases["raw+xxh3"] = lambda: raw(True)
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        rate: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(args.rounds):
            for name, read in cases.items():
                read()  # the blocks back in the page cache if a neighbour dropped it
                flat_dst.zero_()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                hits = read()
                cpu1, wall1 = time.process_time(), time.perf_counter()
                missed = name == "kvtier get" and not all(all(r) for r in hits)
                if missed or bytes(dest) != bytes(source):
                    raise SystemExit(f"round {round_} ({name}): wrong or missing blocks "
                                     f"({tier.counters.errors})")
                cpu[name].append((cpu1 - cpu0) / n * 1e6)
                rate[name].append(n * size / 1e6 / (wall1 - wall0))
                print(f"round {round_} {name}: {cpu[name][-1]:.1f} us CPU per block, "
                      f"{rate[name][-1]:.0f} MB/s")
        for name in cases:
            print(f"median {name}: {statistics.median(cpu[name]):.1f} us CPU per block, "
                  f"{statistics.median(rate[name]):.0f} MB/s")
        print(f"load average {os.getloadavg()[0]:.1f}")
        pool.shutdown()
    finally:
        loop.run_until_complete(tier.close())
        loop.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
