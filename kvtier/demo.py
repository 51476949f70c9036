"""``kvtier demo``: a multi-turn chat workload over a real TieredCache, verified bit for bit.

Each request is a conversation's history so far (a system prompt shared by every conversation,
then alternating user/assistant turns). The demo hashes the prompt into blocks, asks the cache how
much of it is cached, loads that prefix, checks every loaded byte against the KV the "model" would
have computed, "computes" the rest and stores it. KV content is a deterministic function of the
block key (a window into a random fp16 pool), so verification needs no second copy of the cache.

Not a benchmark of an engine: there is no model. It shows the cache doing its job and prints what
each tier did.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.blocks import BlockKey
from kvtier.cache import TieredCache
from kvtier.hashing import hash_token_blocks
from kvtier.hostinfo import available_memory
from kvtier.layout import BlockLayout

#: Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, fp16, 16-token blocks = 2 MiB cross-layer blocks.
LLAMA_8B_MODEL = {"name": "llama-3.1-8b-demo", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                  "dtype": "float16"}


#: What ``kvtier demo --trace`` compares (LRU and the ceilings are always added), and where.
DEMO_POLICIES = ["arc", "sieve", "leaf_lru", "default"]
POLICY_CAPACITIES = ["1%", "2%", "5%", "10%", "25%"]


def default_config(workdir: Path) -> dict[str, Any]:
    """The embedded default: a CPU tier and a file tier under ``workdir``, sized to this machine."""
    avail = available_memory() or 4 << 30
    cpu = min(1 << 30, max(64 << 20, avail // 16))
    free_disk = shutil.disk_usage(workdir).free
    disk = min(4 << 30, max(128 << 20, free_disk // 8))
    return {
        "model": dict(LLAMA_8B_MODEL),
        "hash_block_size": 16,
        "tiers": [
            {"type": "cpu", "name": "cpu", "capacity": cpu, "eviction": "default"},
            {"type": "file", "name": "nvme", "path": str(workdir / "kvtier-files"), "capacity": disk,
             "eviction": "default"},
        ],
        "placement": {"write_mode": "write_back", "promote_on_hit": True},
    }


class KVOracle:
    """The KV a model "computes" for a block: a deterministic window into a random fp16 pool."""

    def __init__(self, layout: BlockLayout, pool_bytes: int = 64 << 20, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        elems = max(pool_bytes // layout.itemsize, layout.numel * 2)
        self.pool = torch.randn(elems, generator=gen, dtype=torch.float32).to(layout.dtype)
        self.layout = layout

    def block(self, key: BlockKey) -> torch.Tensor:
        span = self.pool.numel() - self.layout.numel
        start = xxhash.xxh3_64_intdigest(key.block_hash, seed=key.group_id) % span
        return self.pool[start:start + self.layout.numel].view(self.layout.shape)

    def fill(self, keys: list[BlockKey], out: torch.Tensor) -> None:
        for i, key in enumerate(keys):
            out[i].copy_(self.block(key))

    def mismatches(self, keys: list[BlockKey], loaded: torch.Tensor) -> int:
        """Blocks of ``loaded`` whose bytes differ from the oracle's (a byte compare, not a float one)."""
        return sum(not same_bytes(loaded[i], self.block(k)) for i, k in enumerate(keys))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two CPU tensors (numpy compare: ~10× faster than ``torch.equal`` here)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.contiguous().view(torch.uint8).numpy(),
                               b.contiguous().view(torch.uint8).numpy()))


@dataclass
class DemoResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    blocks_loaded: int
    blocks_verified: int
    mismatched_blocks: int
    blocks_stored: int
    seconds: float


def chat_workload(conversations: int, turns: int, system_tokens: int, turn_tokens: int,
                  seed: int = 0) -> list[np.ndarray]:
    """Prompts of interleaved multi-turn conversations sharing one system prompt."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 128_000, system_tokens)
    histories = [system.copy() for _ in range(conversations)]
    order = [c for c in range(conversations) for _ in range(turns)]
    random.Random(seed).shuffle(order)
    prompts = []
    for c in order:
        user = rng.integers(0, 128_000, turn_tokens)
        histories[c] = np.concatenate([histories[c], user])
        prompts.append(histories[c])
        reply = rng.integers(0, 128_000, turn_tokens)
        histories[c] = np.concatenate([histories[c], reply])
    return prompts


def run_demo(cache: TieredCache, prompts: list[np.ndarray], progress: Any = None) -> DemoResult:
    """Serve ``prompts`` through ``cache``; verify every loaded block against the oracle."""
    spec = cache.spec
    group = spec.groups[0]
    layout = group.layout
    oracle = KVOracle(layout)
    namespace = cache.core.namespace
    assert namespace is not None
    max_blocks = max(len(p) for p in prompts) // layout.block_size + 1
    staging = torch.empty((max_blocks, *layout.shape), dtype=layout.dtype)
    result = DemoResult(0, 0, 0, 0, 0, 0, 0, 0.0)
    start = time.perf_counter()
    for prompt in prompts:
        hashes = hash_token_blocks(prompt, spec.hash_block_size, namespace)
        keys = spec.block_keys(hashes)[group.group_id]
        cached = cache.lookup(keys)
        loaded = cache.load(keys[:cached], staging[:cached]) if cached else 0
        result.mismatched_blocks += oracle.mismatches(keys[:loaded], staging[:loaded])
        result.blocks_verified += loaded
        result.blocks_loaded += loaded
        new = keys[loaded:]
        if new:
            oracle.fill(new, staging[:len(new)])
            chain = [keys[i - 1] if i else None for i in range(loaded, len(keys))]  # hashes are chained
            result.blocks_stored += cache.store(new, staging[:len(new)], predecessors=chain)
        result.requests += 1
        result.prompt_tokens += len(prompt)
        result.hit_tokens += loaded * layout.block_size
        if progress is not None:
            progress()
    result.seconds = time.perf_counter() - start
    return result


def make_workdir(directory: str | None) -> tuple[Path, bool]:
    """The demo's file-tier directory and whether it is a temporary one to remove afterwards."""
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path, False
    return Path(tempfile.mkdtemp(prefix="kvtier-demo-", dir=os.environ.get("TMPDIR"))), True
