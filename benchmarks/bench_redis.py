"""Redis tier throughput next to raw redis-py and redis-benchmark, measured in the same run.

    python benchmarks/bench_redis.py [--url redis://127.0.0.1:6379] [--block-kib 256,2048]
                                     [--mib 512] [--batch 32]

For each block size (``--block-kib``, default ``256,2048``: 2 MiB is a Llama-3-8B-like cross-layer
block, 32 layers × K/V × 16 tokens × 8 heads × 128, 2-byte dtype; 256 KiB its tensor-parallel-8 shard,
one head per rank, where per-request costs show) moves ``--mib`` MiB of blocks in batches of
``--batch`` and prints one table of the median put/get GB/s (of raw block bytes) over ``--repeat``
passes, with the spread, for:

- the Redis tier, without and with lz4, on KV-like data: random-normal fp16 (lz4 finds nothing to
  compress, so it only pays for trying) and random-normal bf16 (byte-shuffled lz4 saves ~16 %); the
  fp16 row without lz4 also with the native helper off (every request through the tier's Python
  RESP client, as with ``KVTIER_NATIVE=0``);
- raw redis-py (hiredis) SET/GET of the same fp16 bytes: pipelined per batch, and each batch
  overlapped over a pool of 4 connections. Raw GET results stay ``bytes`` objects (no copy into
  tensors, no checksum), which favours the baseline;
- valkey-glide's sync client (``pip install 'kvtier[bench]'``; the row is skipped without it): SET
  from the tensors' memory and GET into preallocated tensors (``get(key, buffer=…)``), each batch
  overlapped over 4 threads on its multiplexed connection: a maintained library with a zero-copy
  read, as a standing comparison for the tier's own RESP client (no checksum either);
- ``redis-benchmark`` (if on PATH): values of the block size, 4 clients, no pipelining.

Each pass runs every client once, in turn, so a noisy neighbour slows all rows alike. All clients
write the same keys (``kvtier:bench-<pid>:0:<hash>``), each put overwriting the previous client's
values, as a cache at ``maxmemory`` replaces old blocks; the keys are deleted at the end. The server
needs about 1.3 × ``--mib`` of free memory, this process about 3 × ``--mib``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aredis
import torch

from kvtier.blocks import BlockKey
from kvtier.layout import BlockLayout
from kvtier.tiers.redis import Compression, RedisTier

NAMESPACE = f"bench-{os.getpid()}"


@dataclass
class Row:
    client: str
    data: str
    put: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)
    stored_ratio: float | None = None

    @staticmethod
    def cell(samples: list[float]) -> str:
        if not samples:
            return "—"
        med = statistics.median(samples)
        return f"{med:5.2f} ({min(samples):.2f}–{max(samples):.2f})" if len(samples) > 1 else f"{med:5.2f}"


def kv_layouts(block_kib: int) -> dict[str, BlockLayout]:
    """fp16 and bf16 layouts of ``block_kib``: 32 layers × K/V × 16 tokens × head_dim 128, as many heads
    as fit (8 = 2 MiB, 1 = 256 KiB)."""
    if block_kib % 256:
        raise SystemExit(f"--block-kib {block_kib}: use a multiple of 256 (one KV head of 128 dims)")
    return {name: BlockLayout(num_layers=32, num_kv_heads=block_kib // 256, head_dim=128, block_size=16,
                              dtype=dtype)
            for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))}


def kv_blocks(dtype: torch.dtype, count: int, nbytes: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return list(torch.randn(count, nbytes // 2, generator=gen).to(dtype).view(torch.uint8))


def batches(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


async def rate(fn: Callable[[], Awaitable[None]], nbytes: int) -> float:
    start = time.perf_counter()
    await fn()
    return nbytes / (time.perf_counter() - start) / 1e9


class TierClient:
    """The Redis tier: put all blocks, get them back into tensors, check them, delete them."""

    def __init__(self, url: str, data: str, layout: BlockLayout, blocks: list[torch.Tensor],
                 keys: list[BlockKey], batch: int, compression: Compression, native: bool = True) -> None:
        self.block_bytes = layout.nbytes
        client = "" if native else ", Python client"
        self.row = Row(f"RedisTier compression={compression}{client}", f"{data} randn")
        self.tier = RedisTier("bench", {0: layout}, namespace=NAMESPACE, url=url, compression=compression)
        if not native:  # the tier's own baseline: every request through its Python RESP client
            self.tier._native = False
        self.blocks = blocks
        self.keys = keys
        self.out = [torch.empty(layout.nbytes, dtype=torch.uint8) for _ in blocks]
        self.groups = batches(len(blocks), batch)

    async def one_pass(self) -> None:
        keys = self.keys
        total = len(self.blocks) * self.block_bytes

        async def put_all() -> None:
            for r in self.groups:
                if not all(await self.tier.put([keys[i] for i in r], [self.blocks[i] for i in r])):
                    raise RuntimeError(f"tier put failed: {self.tier.counters.errors}")

        async def get_all() -> None:
            for r in self.groups:
                if not all(await self.tier.get([keys[i] for i in r], [self.out[i] for i in r])):
                    raise RuntimeError(f"tier get missed: {self.tier.counters.errors}")

        self.row.put.append(await rate(put_all, total))
        self.row.get.append(await rate(get_all, total))
        if not all(torch.equal(a, b) for a, b in zip(self.blocks, self.out, strict=True)):
            raise RuntimeError("the tier returned different bytes")
        self.row.stored_ratio = (self.tier.counters.bytes_written / self.tier.counters.blocks_written
                                 / self.block_bytes)

    async def close(self) -> None:
        await self.tier.close()


class RedisPyClient:
    """Raw redis-py SET/GET of the same bytes: one pipeline per batch, or the batch over a pool."""

    def __init__(self, url: str, blocks: list[torch.Tensor], keys: list[BlockKey], batch: int,
                 connections: int) -> None:
        name = f"redis-py, batch over {connections} conns" if connections else "redis-py, pipeline per batch"
        self.row = Row(name, "fp16 randn")
        self.pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max(connections, 1))
        self.client = aredis.Redis(connection_pool=self.pool)
        self.connections = connections
        self.keys = [f"kvtier:{NAMESPACE}:0:{k.block_hash.hex()}".encode() for k in keys]
        self.values = [b.numpy().data for b in blocks]
        self.groups = batches(len(blocks), batch)

    async def one_pass(self) -> None:
        client, keys, values = self.client, self.keys, self.values

        async def put_all() -> None:
            for r in self.groups:
                if self.connections:
                    await asyncio.gather(*(client.set(keys[i], values[i]) for i in r))
                    continue
                pipe = client.pipeline(transaction=False)
                for i in r:
                    pipe.set(keys[i], values[i])
                await pipe.execute()

        async def get_all() -> None:
            for r in self.groups:
                if self.connections:
                    got = await asyncio.gather(*(client.get(keys[i]) for i in r))
                else:
                    pipe = client.pipeline(transaction=False)
                    for i in r:
                        pipe.get(keys[i])
                    got = await pipe.execute()
                if any(g is None for g in got):
                    raise RuntimeError("redis-py GET missed")

        total = sum(v.nbytes for v in values)
        self.row.put.append(await rate(put_all, total))
        self.row.get.append(await rate(get_all, total))

    async def close(self) -> None:
        await self.client.aclose()
        await self.pool.aclose()


class GlideClient:
    """valkey-glide's sync client: SET from tensor memory, GET into tensors, a batch over 4 threads."""

    THREADS = 4

    def __init__(self, url: str, blocks: list[torch.Tensor], keys: list[BlockKey], batch: int) -> None:
        from glide_sync import GlideClient as Glide
        from glide_sync import GlideClientConfiguration, NodeAddress, ServerCredentials

        parts = urlsplit(url)
        credentials = ServerCredentials(parts.password, parts.username or None) if parts.password else None
        config = GlideClientConfiguration([NodeAddress(parts.hostname or "127.0.0.1", parts.port or 6379)],
                                          use_tls=parts.scheme == "rediss", credentials=credentials,
                                          database_id=int(parts.path.strip("/") or 0), request_timeout=10_000)
        self.row = Row(f"valkey-glide sync, {self.THREADS} threads", "fp16 randn")
        self.client: Any = Glide.create(config)
        self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="bench-glide")
        self.keys = [f"kvtier:{NAMESPACE}:0:{k.block_hash.hex()}".encode() for k in keys]
        self.blocks = blocks
        self.values = [b.numpy().data for b in blocks]
        self.out = [torch.empty_like(b) for b in blocks]
        self.out_views = [o.numpy().data for o in self.out]
        self.groups = batches(len(blocks), batch)

    def _run(self, fn: Callable[[int], Any], r: range) -> list[Any]:
        return list(self.pool.map(fn, r))

    async def one_pass(self) -> None:
        client, keys = self.client, self.keys

        async def put_all() -> None:
            for r in self.groups:
                done = await asyncio.to_thread(self._run, lambda i: client.set(keys[i], self.values[i]), r)
                if any(d != "OK" for d in done):
                    raise RuntimeError(f"valkey-glide SET failed: {done[:3]}")

        async def get_all() -> None:
            for r in self.groups:
                got = await asyncio.to_thread(
                    self._run, lambda i: client.get(keys[i], buffer=self.out_views[i]), r)
                if any(g is None for g in got):
                    raise RuntimeError("valkey-glide GET missed")

        total = sum(b.nbytes for b in self.blocks)
        self.row.put.append(await rate(put_all, total))
        self.row.get.append(await rate(get_all, total))
        if not all(torch.equal(a, b) for a, b in zip(self.blocks, self.out, strict=True)):
            raise RuntimeError("valkey-glide returned different bytes")

    async def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class RedisBenchmarkClient:
    """``redis-benchmark -t set,get -d <block bytes> -c 4 -P 1`` (C, hiredis), one run per pass."""

    def __init__(self, binary: str, url: str, requests: int, block_bytes: int) -> None:
        parts = urlsplit(url)
        self.block_bytes = block_bytes
        self.row = Row("redis-benchmark -c 4 (C, hiredis)", f"'x' × {block_bytes >> 10} KiB")
        self.cmd = [binary, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
                    "-t", "set,get", "-d", str(block_bytes), "-n", str(requests), "-c", "4", "-P", "1",
                    "-r", "64", "--csv"]
        if parts.password:
            self.cmd += ["-a", parts.password]

    async def one_pass(self) -> None:
        done = await asyncio.to_thread(subprocess.run, self.cmd, capture_output=True, text=True, timeout=600)
        rates = {m.group(1): float(m.group(2)) * self.block_bytes / 1e9
                 for m in re.finditer(r'"(SET|GET)","([0-9.]+)"', done.stdout)}
        if "SET" not in rates or "GET" not in rates:
            raise RuntimeError(f"redis-benchmark gave no figures: {done.stderr.strip()[:300]}")
        self.row.put.append(rates["SET"])
        self.row.get.append(rates["GET"])

    async def close(self) -> None:
        return None


def print_table(rows: list[Row], args: argparse.Namespace, blocks: int, block_bytes: int) -> None:
    header = f"| {'client':38s} | {'data':14s} | {'put GB/s':18s} | {'get GB/s':18s} | stored/raw |"
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for row in rows:
        ratio = f"{row.stored_ratio:.2f}" if row.stored_ratio is not None else "—"
        print(f"| {row.client:38s} | {row.data:14s} | {Row.cell(row.put):18s} | {Row.cell(row.get):18s} | "
              f"{ratio:>10s} |")
    raw = [r for r in rows if r.client.startswith(("redis-py", "valkey-glide"))]
    tier = next((r for r in rows
                 if r.client == "RedisTier compression=none" and r.data == "fp16 randn"), None)
    if raw and tier is not None:
        best_put = max(statistics.median(r.put) for r in raw)
        best_get = max(statistics.median(r.get) for r in raw)
        print("\nRedisTier (no lz4, fp16) / best library row (redis-py, valkey-glide): "
              f"put ×{statistics.median(tier.put) / best_put:.2f}, "
              f"get ×{statistics.median(tier.get) / best_get:.2f}")
    print(f"\n{blocks} blocks of {block_bytes >> 10} KiB in batches of {args.batch}; median of {args.repeat} "
          f"interleaved passes (min–max); GB/s = raw block bytes / wall time.")
    print("Random-normal fp16 has no repeated byte sequences, so lz4 stores it raw (its lz4 row is the cost "
          "of trying).\nbf16 has 7 mantissa bits: after the byte shuffle its exponent bytes repeat and lz4 "
          "saves ~16 %.")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


async def main(args: argparse.Namespace) -> None:
    probe = redis.Redis.from_url(args.url, socket_connect_timeout=2)
    try:
        version = probe.info("server").get("redis_version")
    finally:
        probe.close()
    try:
        glide = f"valkey-glide-sync {importlib.metadata.version('valkey-glide-sync')}; "
    except importlib.metadata.PackageNotFoundError:
        glide = ""
    print(f"Redis {version} at {args.url}; redis-py {redis.__version__}; {glide}torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs\n")
    for kib in (int(k) for k in args.block_kib.split(",")):
        await one_size(args, kv_layouts(kib))


async def one_size(args: argparse.Namespace, layouts: dict[str, BlockLayout]) -> None:
    """Every client, ``--repeat`` interleaved passes, over blocks of one size; then its table."""
    block_bytes = layouts["fp16"].nbytes
    n = args.mib * (1 << 20) // block_bytes
    fp16, bf16 = kv_blocks(torch.float16, n, block_bytes), kv_blocks(torch.bfloat16, n, block_bytes)
    keys = [BlockKey(os.urandom(32), 0) for _ in range(n)]
    clients: list[TierClient | RedisPyClient | GlideClient | RedisBenchmarkClient] = [
        RedisPyClient(args.url, fp16, keys, args.batch, connections=0),
        RedisPyClient(args.url, fp16, keys, args.batch, connections=4),
        TierClient(args.url, "fp16", layouts["fp16"], fp16, keys, args.batch, "none"),
        TierClient(args.url, "fp16", layouts["fp16"], fp16, keys, args.batch, "none", native=False),
        TierClient(args.url, "fp16", layouts["fp16"], fp16, keys, args.batch, "lz4"),
        TierClient(args.url, "bf16", layouts["bf16"], bf16, keys, args.batch, "none"),
        TierClient(args.url, "bf16", layouts["bf16"], bf16, keys, args.batch, "lz4"),
    ]
    if not args.no_glide:
        try:
            clients.insert(2, GlideClient(args.url, fp16, keys, args.batch))
        except ImportError:
            print("valkey-glide row skipped: pip install 'kvtier[bench]' (valkey-glide-sync)\n")
    binary = shutil.which("redis-benchmark")
    if binary is not None and not args.no_redis_benchmark:
        clients.append(RedisBenchmarkClient(binary, args.url, n, block_bytes))
    try:
        for _ in range(args.repeat):
            for client in clients:
                await client.one_pass()
    finally:
        cleanup = RedisTier("cleanup", {0: layouts["fp16"]}, namespace=NAMESPACE, url=args.url)
        await cleanup.delete(keys)
        await cleanup.close()
        for client in clients:
            await client.close()
    print_table([c.row for c in clients], args, n, block_bytes)
    print(f"load average {os.getloadavg()[0]:.2f}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--block-kib", default="256,2048",
                        help="block sizes in KiB (multiples of 256), comma separated; "
                             "one table each (default 256,2048)")
    parser.add_argument("--mib", type=int, default=512, help="MiB of blocks per pass (default 512)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per put/get call")
    parser.add_argument("--repeat", type=int, default=5,
                        help="interleaved passes; the table shows the median")
    parser.add_argument("--no-redis-benchmark", action="store_true", help="skip the redis-benchmark row")
    parser.add_argument("--no-glide", action="store_true", help="skip the valkey-glide row")
    asyncio.run(main(parser.parse_args()))
