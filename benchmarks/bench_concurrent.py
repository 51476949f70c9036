"""Another thread's lookup and load latency while TieredCache stores, against the same calls on an idle cache.

An engine's scheduler thread asks ``lookup`` (and its loader ``load``) while a background thread stores
the blocks of finished requests. A store into CPU tiers runs on the storing thread
(docs/architecture.md, "Calls on the caller's thread"); what this measures is how long the other thread
waits meanwhile. Not a test: it prints one table per block size.

Per block size: one CPU tier of ``--mib`` MiB holding a hot key (stored first). The probe thread calls
``lookup([hot])`` then ``load([hot])`` every ``--gap-ms`` for ``--seconds``:

- **idle**: nothing else runs (the baseline, same process, same cache);
- **beside stores**: a writer thread meanwhile stores batches of ``--batch`` new blocks without pause
  (every store evicts once the tier is full; the probe's loads keep the hot key recent).

Columns: the probe's latency percentiles (µs), and the writer's store throughput (GB/s).

Usage: ``python benchmarks/bench_concurrent.py [--block-kib 256,2048] [--mib 512] [--batch 32]
[--seconds 4] [--gap-ms 0.5]``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time

import numpy as np
import torch

from kvtier import BlockKey, TieredCache

_PER_LAYER = 2 * 16 * 8 * 128 * 2  # K,V x 16 tokens x 8 KV heads x 128 dims, fp16


def _probe(cache: TieredCache, hot: list[BlockKey], out: torch.Tensor, seconds: float,
           gap: float) -> dict[str, np.ndarray]:
    lookups: list[float] = []
    loads: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = time.perf_counter()
        cache.lookup(hot)
        b = time.perf_counter()
        assert cache.load(hot, out) == 1
        c = time.perf_counter()
        lookups.append(b - a)
        loads.append(c - b)
        time.sleep(gap)
    return {"lookup": np.array(lookups) * 1e6, "load": np.array(loads) * 1e6}


def bench(block_kib: int, mib: int, batch: int, seconds: float, gap: float) -> None:
    size = block_kib * 1024
    n = mib * (1 << 20) // size
    config = {"model": {"name": "bench", "num_layers": size // _PER_LAYER, "num_kv_heads": 8, "head_dim": 128,
                        "dtype": "float16"},
              "hash_block_size": 16, "tiers": [{"type": "cpu", "capacity": n * size, "pinned": False}]}
    with TieredCache.from_config(config) as cache:
        shape = cache.spec.groups[0].layout.shape
        src = torch.empty((batch, *shape), dtype=torch.float16).uniform_()
        hot = [BlockKey(b"hot".ljust(16, b"-"), 0)]
        assert cache.store(hot, src[:1]) == 1
        out = torch.empty((1, *shape), dtype=torch.float16)
        rows = {"idle": _probe(cache, hot, out, seconds, gap)}
        stop = threading.Event()
        stored = [0]

        def writer() -> None:
            i = 0
            while not stop.is_set():
                keys = [BlockKey(b"w" + (i * batch + j).to_bytes(15, "big"), 0) for j in range(batch)]
                stored[0] += cache.store(keys, src)
                i += 1

        thread = threading.Thread(target=writer)
        start = time.perf_counter()
        thread.start()
        rows["beside stores"] = _probe(cache, hot, out, seconds, gap)
        stop.set()
        thread.join()
        rate = stored[0] * size / (time.perf_counter() - start) / 1e9
        assert torch.equal(out[0], src[0])
    print(f"\n{block_kib} KiB blocks, a {n * size >> 20} MiB CPU tier, stores of {batch} blocks")
    print("| probe | calls | lookup p50 | lookup p99 | lookup max | load p50 | load p99 | load max "
          "| writer GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, lat in rows.items():
        cells = [f"{np.percentile(lat[op], q):.0f}" for op in ("lookup", "load") for q in (50, 99, 100)]
        writer = "–" if name == "idle" else f"{rate:.2f}"
        print(f"| {name} | {len(lat['lookup'])} | " + " | ".join(cells) + f" | {writer} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-kib", default="256,2048", help="block sizes in KiB (default 256,2048)")
    parser.add_argument("--mib", type=int, default=512, help="CPU tier size in MiB (default 512)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per store (default 32)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per probe (default 4)")
    parser.add_argument("--gap-ms", type=float, default=0.5, help="pause between probes in ms (default 0.5)")
    args = parser.parse_args(argv)
    print("$ python " + shlex.join(sys.argv) + f"    (load average {os.getloadavg()[0]:.2f})")
    print("latencies in µs")
    for kib in (int(k) for k in args.block_kib.split(",")):
        bench(kib, args.mib, args.batch, args.seconds, args.gap_ms / 1000)


if __name__ == "__main__":
    main()
