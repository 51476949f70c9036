"""kvtier's vLLM manager + worker against vLLM's own CPUOffloadingManager on a request trace.

Both sides are built by vLLM's ``OffloadingSpecFactory`` from one ``OffloadingConfig`` (kvtier's spec
through ``spec_module_path``), with the same number of offloaded blocks, and replay the trace with
the call sequence of vLLM's ``OffloadingConnector`` per request: ``on_new_request`` → ``lookup`` until
the first non-hit → ``prepare_load``/``complete_load`` of the hits → ``prepare_store``/
``complete_store`` of the rest → ``on_request_finished``.

Four sides, in pairs that do the same work:

- ``vllm`` and ``kvtier-mgr``: the managers alone, as in vLLM's scheduler process when the workers are
  other processes (kvtier's index settles each store plan at ``complete_store``); no bytes move.
- ``vllm+copy`` and ``kvtier``: the manager with a worker in the same process, moving every stored
  block's pages out of a (small) KV cache into the offloaded blocks and every loaded one back. vLLM's
  CPU worker needs CUDA (its copies are DMA on a stream), so its stand-in here moves the same bytes
  with one indexed copy per job between the KV cache and a host tensor of all offloaded blocks, at the
  block ids vLLM's specs name; kvtier's side runs kvtier's real worker (copies into its CPU tier).

Reported per eviction policy and capacity (share of the trace's distinct blocks): block hit ratio
(hits / block references), total process CPU per block reference (every thread: kvtier's loop thread
included), and scheduler-thread CPU per manager call (the main thread minus the worker's calls).

    python benchmarks/bench_vllm_manager.py [TRACE] [--capacities 1,10,25] [--limit N] [--sides ...]

TRACE defaults to the Mooncake conversation trace in ``$KVTIER_TRACES`` (else ``traces/``;
docs/traces.md). Needs vLLM.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvtier.traces import read_trace

#: managers alone (the scheduler process when the workers are other processes), then manager + worker in
#: one process (pages copied out of and back into a KV cache); each kvtier side follows vLLM's like side
SIDES = ("vllm", "kvtier-mgr", "vllm+copy", "kvtier")
BASELINE = {"kvtier-mgr": "vllm", "kvtier": "vllm+copy"}
TOKENS_PER_BLOCK = 16
PAGE_BYTES = 2 * TOKENS_PER_BLOCK * 1 * 8 * 2  # K and V, 16 tokens, 1 KV head of 8 bf16 values
ENGINE_BLOCKS = 256


@dataclass
class Result:
    side: str
    policy: str
    capacity_blocks: int
    references: int
    hits: int
    process_seconds: float
    scheduler_seconds: float
    manager_calls: int
    wall_seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0

    @property
    def cpu_us_per_reference(self) -> float:
        return 1e6 * self.process_seconds / self.references

    @property
    def scheduler_us_per_call(self) -> float:
        return 1e6 * self.scheduler_seconds / self.manager_calls


def offloading_config(extra: dict[str, Any], engine_id: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=("layer.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=PAGE_BYTES, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine_id, model=OffloadingModelConfig(name="bench-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
        kv_cache_layout="NHD")


def build_vllm(capacity: int, policy: str) -> tuple[Any, None, int]:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    probe = OffloadingSpecFactory.create_spec(offloading_config({"cpu_bytes_to_use": 1 << 30}, "probe"))
    per_chunk = (1 << 30) // probe.num_chunks  # vLLM's aligned chunk size
    spec = OffloadingSpecFactory.create_spec(offloading_config(
        {"cpu_bytes_to_use": capacity * per_chunk, "eviction_policy": policy}, "vllm"))
    return spec.get_manager(), None, spec.num_chunks


class VllmCopyWorker:
    """A CPU stand-in for vLLM's CPU-offloading worker: one indexed copy per job between the KV cache and a
    host tensor of all offloaded blocks, at the block ids of vLLM's specs (its worker builds the same
    pointer lists and runs one batched DMA copy; the bytes moved are the same)."""

    def __init__(self, blocks: int) -> None:
        self.pages = torch.zeros((ENGINE_BLOCKS, PAGE_BYTES), dtype=torch.int8).numpy()
        self.host = np.zeros((blocks, PAGE_BYTES), dtype=np.int8)
        self._done: list[int] = []

    def submit_store(self, job: int, src: Any, dst: Any) -> bool:
        self.host[dst.block_ids] = self.pages[src.block_ids]
        self._done.append(job)
        return True

    def submit_load(self, job: int, src: Any, dst: Any) -> bool:
        self.pages[dst.block_ids] = self.host[src.block_ids]
        self._done.append(job)
        return True

    def wait(self, jobs: set[int]) -> None:
        return None

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return [SimpleNamespace(job_id=job, success=True) for job in done]

    def shutdown(self) -> None:
        return None


def build_vllm_copy(capacity: int, policy: str) -> tuple[Any, Any, int]:
    manager, _, blocks = build_vllm(capacity, policy)
    return manager, VllmCopyWorker(blocks), blocks


def build_kvtier_manager(capacity: int, policy: str) -> tuple[Any, None, int]:
    """kvtier's manager alone, as in vLLM's scheduler process when the workers are other processes
    (TP, the multiprocess executor): the index settles a plan at ``complete_store``; no bytes move."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    kvtier_config = {"model": {"num_kv_heads": 1, "head_dim": 8},
                     "tiers": [{"type": "cpu", "capacity": capacity * PAGE_BYTES, "eviction": policy}]}
    spec = OffloadingSpecFactory.create_spec(offloading_config(
        {"spec_module_path": "kvtier.connectors.vllm", "spec_name": "KVTierOffloadingSpec",
         "kvtier_config": kvtier_config}, f"kvtier-manager-{policy}-{capacity}"))
    return spec.get_manager(), None, capacity


def build_kvtier(capacity: int, policy: str) -> tuple[Any, Any, int]:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    kvtier_config = {"model": {"num_kv_heads": 1, "head_dim": 8},
                     "tiers": [{"type": "cpu", "capacity": capacity * PAGE_BYTES, "eviction": policy}]}
    spec = OffloadingSpecFactory.create_spec(offloading_config(
        {"spec_module_path": "kvtier.connectors.vllm", "spec_name": "KVTierOffloadingSpec",
         "kvtier_config": kvtier_config}, f"kvtier-{policy}-{capacity}"))
    pages = torch.zeros((ENGINE_BLOCKS, PAGE_BYTES), dtype=torch.int8)
    kv_caches = SimpleNamespace(tensors=[SimpleNamespace(tensor=pages, page_size_bytes=PAGE_BYTES)],
                                group_data_refs=[[SimpleNamespace(tensor_idx=0, page_size_bytes=PAGE_BYTES)]])
    worker = spec.get_worker(kv_caches)  # vLLM builds the worker first (register_kv_caches), then the manager
    return spec.get_manager(), worker, capacity


def replay(side: str, policy: str, requests: list[list[bytes]], capacity: int) -> Result:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext

    build = {"vllm": build_vllm, "kvtier-mgr": build_kvtier_manager, "vllm+copy": build_vllm_copy,
             "kvtier": build_kvtier}[side]
    manager, worker, blocks = build(capacity, policy)
    jobs = itertools.count()
    hit = LookupResult.HIT
    hits = references = calls = 0
    worker_seconds = 0.0

    def run_job(submit: Any, *args: Any) -> None:
        nonlocal worker_seconds
        start = time.thread_time()
        job = next(jobs)
        submit(job, *args)
        worker.wait({job})
        results = worker.get_finished()
        assert len(results) == 1 and results[0].success, results
        worker_seconds += time.thread_time() - start

    gc.collect()
    wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for r, keys in enumerate(requests):
        ctx = ReqContext(req_id=str(r))
        manager.on_new_request(ctx)
        n = 0
        for key in keys:
            calls += 1
            if manager.lookup(key, ctx) != hit:
                break
            n += 1
        references += len(keys)
        hits += n
        if n:
            spec = manager.prepare_load(keys[:n], ctx)
            if worker is not None:
                ids = np.arange(n) % ENGINE_BLOCKS
                run_job(worker.submit_load, spec, GPULoadStoreSpec(ids.tolist(), (n,), (0,)))
            manager.complete_load(keys[:n], ctx)
            calls += 2
        if n < len(keys):
            out = manager.prepare_store(keys[n:], ctx)
            calls += 1
            if out is not None:
                stored = out.keys_to_store
                if worker is not None and stored:
                    ids = np.arange(len(stored)) % ENGINE_BLOCKS
                    run_job(worker.submit_store, GPULoadStoreSpec(ids.tolist(), (len(stored),), (0,)),
                            out.store_spec)
                manager.complete_store(stored, ctx)
                calls += 1
        manager.on_request_finished(ctx)
        calls += 2
    thread = time.thread_time() - thread
    process = time.process_time() - process
    wall = time.perf_counter() - wall
    if worker is not None:
        worker.shutdown()
    runtime = getattr(manager, "runtime", None)
    if runtime is not None and not runtime._closed:  # kvtier-mgr's own; kvtier's closed with its worker
        runtime.close()
    return Result(side, policy, blocks, references, hits, process, thread - worker_seconds, calls, wall)


def default_trace() -> Path:
    root = Path(os.environ.get("KVTIER_TRACES", Path(__file__).resolve().parents[1] / "traces"))
    return root / "mooncake_conversation.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, default=None)
    parser.add_argument("--capacities", default="1,10,25", help="percent of the trace's distinct blocks")
    parser.add_argument("--policies", default="lru", help="comma-separated: lru (and arc for vLLM's ARC)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    args = parser.parse_args()
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"--sides: unknown {unknown}; known: {list(SIDES)}")
    torch.set_num_threads(1)  # a worker's page copies are a few KiB: intra-op threads only add wake-ups
    path = args.trace or default_trace()
    trace = read_trace(path, limit=args.limit)
    requests = [[k.block_hash.rjust(32, b"\0") + (0).to_bytes(4, "big") for k in keys]
                for keys in trace.requests]
    print(f"trace {path.name}: {len(requests)} requests, {trace.references} block references, "
          f"{trace.distinct_blocks} distinct blocks; python {sys.version.split()[0]}, "
          f"torch {torch.__version__}")
    header = (f"{'policy':<6} {'capacity':>14} {'side':<10} {'hit ratio':>9} {'CPU µs/ref':>10} "
              f"{'sched µs/call':>13} {'wall s':>7}")
    print(header)
    print("-" * len(header))
    for policy in args.policies.split(","):
        for percent in (float(p) for p in args.capacities.split(",")):
            capacity = max(1, int(trace.distinct_blocks * percent / 100))
            results = {}
            for side in sides:  # same process, same trace, one after the other
                res = replay(side, policy, requests, capacity)
                results[side] = res
                where = f"{percent:g}% ({res.capacity_blocks})"
                print(f"{policy:<6} {where:>14} {side:<10} {res.hit_ratio:>9.4f} "
                      f"{res.cpu_us_per_reference:>10.2f} {res.scheduler_us_per_call:>13.3f} "
                      f"{res.wall_seconds:>7.1f}")
            for ours_side, theirs_side in BASELINE.items():
                if ours_side not in results or theirs_side not in results:
                    continue
                ours, theirs = results[ours_side], results[theirs_side]
                print(f"{'':<6} {'':>14} {ours_side + '/' + theirs_side:<20} "
                      f"{ours.hit_ratio - theirs.hit_ratio:>+9.4f} "
                      f"{ours.cpu_us_per_reference / theirs.cpu_us_per_reference:>9.2f}x "
                      f"{ours.scheduler_us_per_call / theirs.scheduler_us_per_call:>12.2f}x")


if __name__ == "__main__":
    main()
