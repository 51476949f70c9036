"""What ``placement.persist_on_close`` costs at shutdown, next to the file tier's own write speed.

Not a test: it prints one table, with its baseline measured in the same run, and the command line
that made it. A CPU tier holds N blocks (``write_back``: none of them are on disk yet) over a file
tier in DIR. Rows:

- ``close()`` with ``persist_on_close: false`` — the old shutdown: nothing written, the blocks are lost;
- ``close()`` with ``persist_on_close: true`` (the default) — every block written down;
- baseline: the same blocks stored straight into a file-tier-only cache (``store`` of N blocks), the
  file tier's write speed through the same cache code.

Usage: ``python benchmarks/bench_persist.py [--blocks 256] [--block-kib 2048] [--dir DIR]``; DIR must be
on the disk under test; the default is a fresh directory under the current one.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier import BlockKey, TieredCache


def _config(root: Path, blocks: int, block_kib: int, persist: bool, cpu: bool) -> dict[str, Any]:
    # 2 layers x K,V x 16 tokens x heads x 64 dims x fp16 = block_kib KiB
    heads = block_kib * 1024 // (2 * 2 * 16 * 64 * 2)
    block = 2 * 2 * 16 * heads * 64 * 2
    tiers: list[dict[str, Any]] = [{"type": "file", "path": str(root), "capacity": 2 * blocks * block}]
    if cpu:
        tiers.insert(0, {"type": "cpu", "capacity": blocks * block})
    return {"model": {"name": f"bench-persist-{block_kib}", "num_layers": 2, "num_kv_heads": heads,
                      "head_dim": 64},
            "hash_block_size": 16, "tiers": tiers,
            "placement": {"write_mode": "write_back", "persist_on_close": persist}}


def _blocks(cache: TieredCache, n: int) -> tuple[list[BlockKey], torch.Tensor]:
    layout = cache.spec.groups[0].layout
    keys = [BlockKey(i.to_bytes(16, "little"), 0) for i in range(n)]
    data = (torch.randint(0, 256, (n, layout.nbytes), dtype=torch.uint8)
            .view(layout.dtype).view(n, *layout.shape))
    return keys, data


def _close_seconds(root: Path, blocks: int, block_kib: int, persist: bool) -> tuple[float, int]:
    cache = TieredCache.from_config(_config(root, blocks, block_kib, persist, cpu=True))
    keys, data = _blocks(cache, blocks)
    assert cache.store(keys, data) == blocks
    start = time.perf_counter()
    cache.close()
    seconds = time.perf_counter() - start
    written = next(t for t in cache.stats().tiers if t.kind == "file").bytes_written
    return seconds, written


def _store_seconds(root: Path, blocks: int, block_kib: int) -> tuple[float, int]:
    cache = TieredCache.from_config(_config(root, blocks, block_kib, False, cpu=False))
    keys, data = _blocks(cache, blocks)
    start = time.perf_counter()
    assert cache.store(keys, data) == blocks
    seconds = time.perf_counter() - start
    written = next(t for t in cache.stats().tiers if t.kind == "file").bytes_written
    cache.close()
    return seconds, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-persist-", dir=args.dir or Path.cwd()))
    try:
        rows = []
        for name, run in (("close(), persist_on_close: false (nothing kept)",
                           lambda d: _close_seconds(d, args.blocks, args.block_kib, False)),
                          ("close(), persist_on_close: true",
                           lambda d: _close_seconds(d, args.blocks, args.block_kib, True)),
                          ("baseline: store() into a file-only cache",
                           lambda d: _store_seconds(d, args.blocks, args.block_kib))):
            seconds, written = run(base / str(len(rows)))
            rows.append((name, seconds, written))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"{args.blocks} blocks of {args.block_kib} KiB in the CPU tier, "
          f"file tier in {args.dir or 'the current directory'}")
    print()
    print("| shutdown | seconds | MiB written | GB/s |")
    print("|---|---:|---:|---:|")
    for name, seconds, written in rows:
        rate = written / seconds / 1e9 if written and seconds else 0.0
        print(f"| {name} | {seconds:.3f} | {written / 2**20:.0f} | {rate:.2f} |")


if __name__ == "__main__":
    main()
