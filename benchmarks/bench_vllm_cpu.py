"""kvtier as vLLM's offloading backend on vLLM's CPU build: time to first token, and the metadata path.

Not a test: it prints two tables, each with its baseline measured in the same run, and the command.

1. TTFT on a shared-prefix workload (``--requests`` prompts of ``--prompt-tokens`` tokens sharing the
   first ``--shared-tokens``) on a tiny random Llama: each configuration runs the batch once to fill
   its caches, drops vLLM's GPU prefix cache (``reset_prefix_cache``), then sends the requests one by
   one with ``max_tokens=1`` (so the request latency is the time to first token); medians of ``--repeat`` passes. Configurations: no
   offloading (recompute), kvtier CPU tier, kvtier file tier (the files are in the page cache).
2. The scheduler-side metadata path on one key stream: ``lookup`` calls per second (all hits),
   ``prepare_store + complete_store`` and ``prepare_load`` calls per second (batches of ``--batch``
   keys), kvtier's manager next to vLLM's own ``CPUOffloadingManager``. kvtier's ``prepare_load``
   includes its one hop to kvtier's loop thread (the pins that make a promised block stay put).

Usage: ``python benchmarks/bench_vllm_cpu.py [--requests 8] [--prompt-tokens 1500] [--shared-tokens 1024] [--repeat 5]``
(needs vLLM: run it with ``.venv-vllm/bin/python`` after ``bash .ci/run_vllm``).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Intel OpenMP threads of vLLM's CPU backend spin 200 ms after each kernel by default, starving
# kvtier's I/O thread on a small machine (loads then wait on thread wake-ups); docs/vllm.md says so.
os.environ.setdefault("KMP_BLOCKTIME", "0")

BLOCK_SIZE = 32


def tiny_llama(path: Path) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_llm(model: Path, kvtier_config: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if kvtier_config is None else KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_module_path": "kvtier.connectors.vllm", "spec_name": "KVTierOffloadingSpec",
                                   "kvtier_config": kvtier_config})
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=4096,
               kv_cache_memory_bytes=256 << 20, enforce_eager=True, seed=0, kv_transfer_config=transfer)


def ttft(model: Path, kvtier_config: dict[str, Any] | None, prompts: list[list[int]],
         repeat: int) -> tuple[float, float, int]:
    """(mean TTFT s, first request's TTFT s, mean cached tokens) after a prefix-cache reset; medians of ``repeat``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model, kvtier_config)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    try:
        llm.generate(requests, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # fill the caches
        llm.generate(requests[:1], params, use_tqdm=False)  # let the last stores land
        means, firsts, cached = [], [], []
        for _ in range(repeat):
            llm.reset_prefix_cache()
            times = []
            for request in requests:
                start = time.perf_counter()
                out = llm.generate([request], params, use_tqdm=False)[0]
                times.append(time.perf_counter() - start)
                cached.append(out.num_cached_tokens or 0)
            means.append(statistics.mean(times))
            firsts.append(times[0])
        return statistics.median(means), statistics.median(firsts), int(statistics.mean(cached))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def rate(fn: Any, count: int) -> float:
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def metadata_path(num_keys: int, batch: int) -> list[tuple[str, float, float]]:
    """(operation, vLLM CPUOffloadingManager calls/s, kvtier manager calls/s)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.connectors.vllm import (
        EngineGeometry,
        EngineGroup,
        KeyCodec,
        KVTierOffloadManager,
        OffloadRuntime,
        kvtier_config_for_engine,
    )

    rng = random.Random(0)
    keys = [make_offload_key(rng.randbytes(32), 0) for _ in range(num_keys)]
    fresh = [make_offload_key(rng.randbytes(32), 0) for _ in range(num_keys)]
    stream = [keys[rng.randrange(num_keys)] for _ in range(20 * num_keys)]
    batches = [keys[i:i + batch] for i in range(0, num_keys - batch + 1, batch)]
    ctx = ReqContext(req_id="bench")

    vllm_mgr = CPUOffloadingManager(num_chunks=2 * num_keys, cache_policy="lru")
    vllm_mgr.on_new_request(ctx)
    vllm_mgr.complete_store(vllm_mgr.prepare_store(keys, ctx).keys_to_store, ctx)

    geometry = EngineGeometry(model_name="bench", dtype="bfloat16", tokens_per_hash=16, blocks_per_chunk=1,
                              groups=(EngineGroup(0, 16, 1),), num_kv_heads=1, head_dim=8, mla=False)
    config = kvtier_config_for_engine({"tiers": [{"type": "cpu", "capacity": 4 * num_keys * 512}]}, geometry)
    runtime = OffloadRuntime(config, KeyCodec([0]))
    ours = KVTierOffloadManager(runtime)
    chosen, spec = ours.plan_store(keys)
    _, blocks = runtime.empty_blocks(0, len(spec.keys))
    runtime.call(runtime.core.store(list(spec.keys), blocks))
    ours.complete_store(chosen)

    rows = []
    def lookups(manager: Any) -> Any:
        return lambda: [manager.lookup(k, ctx) for k in stream]

    rows.append(("lookup (hit)", rate(lookups(vllm_mgr), len(stream)), rate(lookups(ours), len(stream))))

    def stores(m: Any, prepare: Any) -> Any:
        fresh_batches = [fresh[i:i + batch] for i in range(0, num_keys - batch + 1, batch)]
        return lambda: [m.complete_store(prepare(b), ctx) for b in fresh_batches]

    rows.append((f"prepare_store+complete ({batch} keys)",
                 rate(stores(vllm_mgr, lambda b: vllm_mgr.prepare_store(b, ctx).keys_to_store), len(batches)),
                 rate(stores(ours, lambda b: ours.plan_store(b)[0]), len(batches))))

    def vllm_loads() -> None:
        for b in batches:
            vllm_mgr.prepare_load(b, ctx)
            vllm_mgr.complete_load(b, ctx)

    leases = []

    def our_loads() -> None:
        for b in batches:
            leases.append(ours.prepare_load(b, ctx))
            ours.complete_load(b, ctx)

    rows.append((f"prepare_load+complete ({batch} keys)", rate(vllm_loads, len(batches)), rate(our_loads, len(batches))))
    for lease in leases:
        runtime.call(runtime.release(lease.keys, lease.sources))
    runtime.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per configuration (medians)")
    parser.add_argument("--keys", type=int, default=4096, help="keys in the metadata-path stream")
    parser.add_argument("--batch", type=int, default=16, help="keys per prepare_store / prepare_load call")
    args = parser.parse_args()

    import torch
    import vllm

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    model = tiny_llama(workdir / "tiny-llama")
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(args.shared_tokens)]
    prompts = [shared + [rng.randrange(1, 500) for _ in range(args.prompt_tokens - args.shared_tokens)]
               for _ in range(args.requests)]
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("no offloading (recompute)", None),
        ("kvtier CPU tier", {"tiers": [{"type": "cpu", "capacity": "256MiB"}]}),
        ("kvtier file tier", {"tiers": [{"type": "file", "path": str(workdir / "nvme"), "capacity": "1GiB"}]}),
    ]
    results = [(name, *ttft(model, config, prompts, args.repeat)) for name, config in configs]
    meta = metadata_path(args.keys, args.batch)

    print(f"\nvLLM {vllm.__version__} (CPU build), torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, KMP_BLOCKTIME={os.environ['KMP_BLOCKTIME']}; tiny Llama (2 layers, 2 KV heads × 32, bf16), block {BLOCK_SIZE} tokens")
    print(f"{args.requests} requests × {args.prompt_tokens} tokens sharing {args.shared_tokens}, "
          f"sent one by one after reset_prefix_cache, max_tokens=1; medians of {args.repeat} passes\n")
    base = results[0][1]
    print(f"| {'configuration':<26} | {'mean TTFT ms':>12} | {'1st request ms':>14} | {'cached tokens':>13} | {'vs recompute':>12} |")
    print(f"|{'-' * 28}|{'-' * 13}:|{'-' * 15}:|{'-' * 14}:|{'-' * 13}:|")
    for name, mean, first, cached in results:
        print(f"| {name:<26} | {mean * 1e3:>12.1f} | {first * 1e3:>14.1f} | {cached:>13} | {base / mean:>11.2f}× |")
    print(f"\nScheduler metadata path, {args.keys} resident keys, {20 * args.keys} lookups\n")
    print(f"| {'operation':<36} | {'vLLM CPUOffloadingManager /s':>28} | {'kvtier manager /s':>17} | {'kvtier / vLLM':>13} |")
    print(f"|{'-' * 38}|{'-' * 29}:|{'-' * 18}:|{'-' * 14}:|")
    for name, theirs, ours in meta:
        print(f"| {name:<36} | {theirs:>28,.0f} | {ours:>17,.0f} | {ours / theirs:>12.2f}× |")
    print("\ncommand: " + " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]))


if __name__ == "__main__":
    main()
