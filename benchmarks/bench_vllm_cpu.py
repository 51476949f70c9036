"""kvtier as vLLM's offloading backend on vLLM's CPU build: time to first token, and the metadata path.

Not a test: it prints two tables, each with its baseline measured in the same run, and the command.

1. TTFT on a shared-prefix workload (``--requests`` prompts of ``--prompt-tokens`` tokens sharing the
   first ``--shared-tokens``) on a tiny random Llama. Each configuration — no offloading (recompute),
   kvtier CPU tier, kvtier file tier (the files are in the page cache), kvtier Redis tier (``--redis-url``,
   skipped with a note when no server answers there) — has its own engine in its own
   process (vLLM keeps one KV connector per process), started together and warmed once (the batch
   fills the caches). Then ``--repeat`` rounds; in each round every engine runs one pass, one engine at
   a time while the others sleep, in an order that rotates from round to round: a pass drops vLLM's
   GPU prefix cache (``reset_prefix_cache``) and sends the requests one by one with ``max_tokens=1``
   (the request latency is the time to first token). A slow moment of the machine hits the passes of
   one round alike, so each configuration is compared with the recompute pass of *its own round*:
   the table gives per configuration the median over rounds of the pass mean, its spread (min–max
   over rounds), the median first request, and the median of the per-round ratios to recompute.
2. The scheduler-side metadata path on one key stream, through vLLM's own interface (vLLM's
   ``OffloadingManager`` methods, ``PrepareStoreOutput``, ``LoadStoreSpec``, events on): ``lookup``
   calls per second (all hits), ``prepare_store + complete_store`` and ``prepare_load`` + its unpin
   (batches of ``--batch`` keys), kvtier's manager next to vLLM's own ``CPUOffloadingManager``;
   interleaved passes, medians and min–max. Same semantics on both sides: a prepared load pins its
   blocks and the unpin is timed (vLLM's ``complete_load``; kvtier's is the worker's release after its
   read), a prepared store is pending until ``complete_store``, a completed store is reported as an
   event, and no eviction happens in the timed sections (both caches have room).

``--switch-interval`` sets the GIL switch interval of every engine process (recompute included): kvtier's
file-tier reads run on kvtier's threads, which wait for the GIL while vLLM's engine thread spins
(docs/vllm.md).

``--model qwen2-0.5b`` replaces the tiny model by one of realistic depth (random weights in Qwen2-0.5B's
shape), whose recompute costs what it costs a user.

Usage: ``python benchmarks/bench_vllm_cpu.py [--model tiny|qwen2-0.5b] [--requests 8] [--prompt-tokens 1500]
[--shared-tokens 1024] [--repeat 9] [--meta-repeat 9] [--switch-interval 0.0005]
[--redis-url redis://127.0.0.1:6379/0]`` (needs vLLM: run it with
``.venv-vllm/bin/python`` after ``bash .ci/run_vllm``).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
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

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def qwen2_0_5b_shape(path: Path) -> Path:
    """Random weights in Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads × 64, MLP 4864),
    bf16, with a 32k vocabulary (the real one is 152k: the embedding does not change what a prefill
    computes per layer): a recompute that costs what it costs a user."""
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864,
                                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=True,
                                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


MODELS = {"tiny": (tiny_llama, "tiny Llama (2 layers, 2 KV heads × 32, bf16)"),
          "qwen2-0.5b": (qwen2_0_5b_shape, "random Qwen2-0.5B shape (24 layers, 2 KV heads × 64, bf16)")}


def make_llm(model: Path, kvtier_config: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if kvtier_config is None else KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_module_path": "kvtier.connectors.vllm",
                                   "spec_name": "KVTierOffloadingSpec", "kvtier_config": kvtier_config})
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=4096,
               kv_cache_memory_bytes=256 << 20, enforce_eager=True, seed=0, kv_transfer_config=transfer)


# --- 1. time to first token ------------------------------------------------------------------------------
def serve_engine(conn: Connection, model: str, kvtier_config: dict[str, Any] | None,
                 prompts: list[list[int]], switch_interval: float | None) -> None:
    """Child process: one engine, warmed; on each "pass" command run one timed pass and send its result."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)

    llm = make_llm(Path(model), kvtier_config)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # fill the caches
    llm.generate(requests[:1], params, use_tqdm=False)  # let the last stores land
    conn.send("ready")
    while conn.recv() == "pass":
        llm.reset_prefix_cache()
        times, cached = [], []
        for request in requests:
            start = time.perf_counter()
            out = llm.generate([request], params, use_tqdm=False)[0]
            times.append(time.perf_counter() - start)
            cached.append(out.num_cached_tokens or 0)
        conn.send((times, cached))
    llm.llm_engine.engine_core.shutdown()
    conn.send("stopped")


def ttft_rounds(
    model: Path, configs: list[tuple[str, dict[str, Any] | None]], prompts: list[list[int]],
    repeat: int, switch_interval: float | None = None,
) -> list[list[tuple[list[float], list[int]]]]:
    """Per round, per configuration: (request TTFTs s, cached tokens per request)."""
    ctx = multiprocessing.get_context("spawn")
    engines = []
    try:
        for _, config in configs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve_engine,
                               args=(child, str(model), config, prompts, switch_interval), daemon=True)
            proc.start()
            engines.append((proc, parent))
            if parent.recv() != "ready":  # one engine starts at a time: start-up is not measured alongside
                raise RuntimeError("an engine did not start")
        rounds = []
        for r in range(repeat):
            results: list[Any] = [None] * len(configs)
            for k in range(len(configs)):
                i = (r + k) % len(configs)
                engines[i][1].send("pass")
                results[i] = engines[i][1].recv()
            rounds.append(results)
        return rounds
    finally:
        for proc, conn in engines:
            try:
                conn.send("stop")
                conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


# --- 2. the metadata path --------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def metadata_path(num_keys: int, batch: int, repeat: int) -> list[tuple[str, list[float], list[float]]]:
    """(operation, vLLM CPUOffloadingManager calls/s per pass, kvtier manager calls/s per pass)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.connectors import vllm as adapter

    rng = random.Random(0)
    keys = [make_offload_key(rng.randbytes(32), 0) for _ in range(num_keys)]
    stream = [keys[rng.randrange(num_keys)] for _ in range(20 * num_keys)]
    batches = [keys[i:i + batch] for i in range(0, num_keys - batch + 1, batch)]
    fresh = [[[make_offload_key(rng.randbytes(32), 0) for _ in range(batch)] for _ in batches]
             for _ in range(2 * repeat)]  # new keys for every store pass
    ctx = ReqContext(req_id="bench")

    theirs = CPUOffloadingManager(num_chunks=(1 + 2 * repeat) * num_keys, cache_policy="lru",
                                  enable_events=True)
    theirs.on_new_request(ctx)
    theirs.complete_store(theirs.prepare_store(keys, ctx).keys_to_store, ctx)

    geometry = adapter.EngineGeometry(model_name="bench", dtype="bfloat16", tokens_per_hash=16,
                                      blocks_per_chunk=1, groups=(adapter.EngineGroup(0, 16, 1),),
                                      num_kv_heads=1, head_dim=8, mla=False)
    config = adapter.kvtier_config_for_engine({"tiers": [{"type": "cpu", "capacity": 4 * num_keys * 512}]},
                                              geometry)
    runtime = adapter.OffloadRuntime(config, adapter.KeyCodec([0]))
    ours = adapter.KVTierOffloadingManager(runtime, enable_events=True)  # vLLM's class, built from vLLM's API
    ours.on_new_request(ctx)
    out = ours.prepare_store(keys, ctx)
    _, blocks = runtime.empty_blocks(0, len(out.store_spec.keys))
    runtime.call(runtime.write(out.store_spec.plan, list(out.store_spec.keys), list(blocks)))
    ours.complete_store(out.keys_to_store, ctx)

    def lookups(manager: Any) -> Callable[[], Any]:
        lookup = manager.lookup
        return lambda: [lookup(k, ctx) for k in stream]

    _, one_batch = runtime.empty_blocks(0, batch)

    def stores(manager: Any, pass_keys: list[list[bytes]]) -> Callable[[], None]:
        def run() -> None:
            for b in pass_keys:
                out = manager.prepare_store(b, ctx)
                if manager is ours:  # kvtier's plan is the worker's to run: the index holds what it placed
                    spec = out.store_spec
                    runtime.call(runtime.write(spec.plan, list(spec.keys), list(one_batch[:len(spec.keys)])))
                manager.complete_store(out.keys_to_store, ctx)
        return run

    def their_loads() -> None:
        for b in batches:
            theirs.prepare_load(b, ctx)
            theirs.complete_load(b, ctx)

    def our_loads() -> None:
        for b in batches:
            spec = ours.prepare_load(b, ctx)
            runtime.release(spec.keys, spec.sources)  # what the worker does after its read
            ours.complete_load(b, ctx)

    rows: list[tuple[str, list[float], list[float]]] = [
        ("lookup (hit)", [], []), (f"prepare_store+complete ({batch} keys)", [], []),
        (f"prepare_load+unpin ({batch} keys)", [], [])]
    sides = [(1, theirs, their_loads), (2, ours, our_loads)]  # column of ``rows``, manager, its loads
    for r in range(repeat):
        for side, manager, loads in sides if r % 2 == 0 else sides[::-1]:
            rows[0][side].append(len(stream) / timed(lookups(manager)))
            rows[1][side].append(len(batches) / timed(stores(manager, fresh[2 * r + side - 1])))
            rows[2][side].append(len(batches) / timed(loads))
            list(manager.take_events())
    assert not any(index.pins for index in runtime.residency.tiers), "kvtier leaked a pin"
    runtime.close()
    return rows


# --- report -------------------------------------------------------------------------------------------------
def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(min(values) * scale)}–{fmt.format(max(values) * scale)}"


def redis_down(url: str) -> str | None:
    """Why the Redis row cannot run (the server at ``url`` does not answer), or None when it can."""
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1.0).ping()
    except Exception as exc:
        return f"Redis at {url} does not answer: {exc!r}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: 2 layers (recompute nearly free); qwen2-0.5b: a model of realistic depth")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=9, help="interleaved TTFT rounds (medians)")
    parser.add_argument("--keys", type=int, default=4096, help="keys in the metadata-path stream")
    parser.add_argument("--batch", type=int, default=16, help="keys per prepare_store / prepare_load call")
    parser.add_argument("--meta-repeat", type=int, default=9,
                        help="interleaved metadata-path passes (medians)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="Redis server of the Redis-tier row (skipped, with a note, if it does not "
                             "answer)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in every engine process, recompute included (default: "
                             "Python's 5 ms); see docs/vllm.md on the file tier")
    args = parser.parse_args()

    import torch
    import vllm

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    make_model, model_text = MODELS[args.model]
    model = make_model(workdir / args.model)
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(args.shared_tokens)]
    prompts = [shared + [rng.randrange(1, 500) for _ in range(args.prompt_tokens - args.shared_tokens)]
               for _ in range(args.requests)]
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("no offloading (recompute)", None),
        ("kvtier CPU tier", {"tiers": [{"type": "cpu", "capacity": "256MiB"}]}),
        ("kvtier file tier",
         {"tiers": [{"type": "file", "path": str(workdir / "nvme"), "capacity": "1GiB"}]}),
    ]
    # the namespace holds the random checkpoint's identity (its path and mtimes): this run's keys are its own,
    # and the TTL ages them out of a shared server
    redis_note = redis_down(args.redis_url)
    if redis_note is None:
        redis_tier = {"type": "redis", "url": args.redis_url, "ttl_seconds": 600}
        configs.append(("kvtier Redis tier", {"tiers": [redis_tier]}))
    load_before = os.getloadavg()
    rounds = ttft_rounds(model, configs, prompts, args.repeat, args.switch_interval)
    meta = metadata_path(args.keys, args.batch, args.meta_repeat)
    load_after = os.getloadavg()

    print(f"\nvLLM {vllm.__version__} (CPU build), torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"KMP_BLOCKTIME={os.environ['KMP_BLOCKTIME']}, GIL switch interval "
          f"{(args.switch_interval or sys.getswitchinterval()) * 1e3:g} ms, load average "
          f"{load_before[0]:.2f} → {load_after[0]:.2f}; {model_text}, "
          f"block {BLOCK_SIZE} tokens")
    print(f"{args.requests} requests × {args.prompt_tokens} tokens sharing {args.shared_tokens}, "
          f"sent one by one after reset_prefix_cache, max_tokens=1; {args.repeat} interleaved rounds "
          f"(one pass per engine per round, rotating order); medians over rounds, spread = min–max of "
          f"the pass means\n")
    print(f"| {'configuration':<26} | {'mean TTFT ms':>12} | {'spread ms':>13} | {'1st request ms':>14} | "
          f"{'cached tokens':>13} | {'vs recompute':>12} |")
    print(f"|{'-' * 28}|{'-' * 13}:|{'-' * 14}:|{'-' * 15}:|{'-' * 14}:|{'-' * 13}:|")
    base_means = [statistics.mean(rnd[0][0]) for rnd in rounds]
    for i, (name, _) in enumerate(configs):
        means = [statistics.mean(rnd[i][0]) for rnd in rounds]
        firsts = [rnd[i][0][0] for rnd in rounds]
        cached = statistics.median(c for rnd in rounds for c in rnd[i][1])
        ratio = statistics.median(b / m for b, m in zip(base_means, means, strict=True))
        print(f"| {name:<26} | {statistics.median(means) * 1e3:>12.1f} | {spread(means, 1e3):>13} | "
              f"{statistics.median(firsts) * 1e3:>14.1f} | {cached:>13.0f} | {ratio:>11.2f}× |")
    if redis_note is not None:
        print(f"(no kvtier Redis tier row: {redis_note})")
    print(f"\nScheduler metadata path through vLLM's OffloadingManager interface (events on), "
          f"{args.keys} resident keys, {20 * args.keys} lookups; {args.meta_repeat} interleaved passes, "
          f"medians (min–max)\n")
    print(f"| {'operation':<32} | {'vLLM CPUOffloadingManager /s':>30} | {'kvtier manager /s':>30} | "
          f"{'kvtier / vLLM':>13} |")
    print(f"|{'-' * 34}|{'-' * 31}:|{'-' * 31}:|{'-' * 14}:|")
    for name, theirs, ours in meta:
        t, o = statistics.median(theirs), statistics.median(ours)
        their_cell = f"{t:,.0f} ({spread(theirs, fmt='{:,.0f}')})"
        our_cell = f"{o:,.0f} ({spread(ours, fmt='{:,.0f}')})"
        print(f"| {name:<32} | {their_cell:>30} | {our_cell:>30} | {o / t:>12.2f}× |")
    print("\ncommand: " + " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]))


if __name__ == "__main__":
    main()
