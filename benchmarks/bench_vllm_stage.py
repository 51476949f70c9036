"""What promising a file-tier block costs when vLLM's workers run in processes of their own.

The scheduler's manager asks every rank, over the stage channel (Unix sockets), to stage a chain of
blocks verified and pinned; a lookup answers HIT once all ranks did. Measured: the wall time from the
first lookup of a chain to all of it answering HIT, stepping the scheduler every ``--step-ms`` as
vLLM's engine loop would, for 1 and 2 ranks, against the same chain read by a manager that shares
its process with the worker (no socket: ``OffloadRuntime.fetch``). The ranks run as threads of this
process here, so the figures hold the channel's and the reads' costs, not a second process's
scheduling. Rounds are interleaved; medians with min–max.

    python benchmarks/bench_vllm_stage.py [--blocks 8,64] [--rounds 7] [--step-ms 1]

Needs no vLLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.connectors.vllm import (
    EngineGeometry,
    EngineGroup,
    KeyCodec,
    KVTierOffloadManager,
    Lookup,
    OffloadRuntime,
    kvtier_config_for_engine,
)
from kvtier.connectors.vllm.stage_channel import StageClient, StageServer, socket_path


def geometry(rank: int, ranks: int, name: str) -> EngineGeometry:
    return EngineGeometry(model_name=name, dtype="bfloat16", tokens_per_hash=32, blocks_per_chunk=1,
                          groups=(EngineGroup(0, 32, 2),), kv_cache_layout="LBHNC", num_kv_heads=2,
                          head_dim=32, mla=False, tp_rank=rank, tp_size=ranks)


def keys_of(n: int, salt: int) -> list[bytes]:
    return [(salt * 100_000 + i).to_bytes(32, "little") + (0).to_bytes(4, "big") for i in range(n)]


class Setup:
    """``ranks`` = 0: the manager beside the worker (one process); else a split engine of that many ranks."""

    def __init__(self, ranks: int, root: Path) -> None:
        self.ranks = ranks
        name = f"bench-stage-{ranks}-{os.getpid()}"
        tiers = {"tiers": [{"type": "file", "path": str(root / f"r{ranks}"), "capacity": "2GiB"}]}
        size = max(ranks, 1)
        self.workers = [OffloadRuntime(kvtier_config_for_engine(tiers, geometry(r, size, name)),
                                       KeyCodec([0])) for r in range(size)]
        self.servers: list[StageServer] = []
        self.stage: StageClient | None = None
        if ranks:
            engine_id = f"bench-{ranks}-{os.getpid()}"
            self.servers = [StageServer(socket_path(engine_id, r), w.stage_chains, w.release_staged)
                            for r, w in enumerate(self.workers)]
            self.stage = StageClient([socket_path(engine_id, r) for r in range(ranks)])
            index = OffloadRuntime(kvtier_config_for_engine(tiers, geometry(0, size, name)), KeyCodec([0]),
                                   index_only=True)
            self.manager = KVTierOffloadManager(index, stage=self.stage)
        else:
            self.manager = KVTierOffloadManager(self.workers[0])

    def fill(self, keys: list[bytes]) -> None:
        """Store the chain into every rank's file tier and the manager's index, as a store job would."""
        planned = self.manager.plan_store(keys)
        assert planned is not None
        chosen, spec = planned
        for w in self.workers:
            layout = w.core.layouts[0]
            rows = [torch.randint(0, 255, (layout.nbytes,), dtype=torch.uint8) for _ in chosen]
            w.store(spec.plan, list(spec.keys), rows, placed=spec.placed).result()
        self.manager.complete_store(chosen)

    def measure(self, keys: list[bytes], step_s: float) -> float:
        start = time.perf_counter()
        while True:
            answers = [self.manager.lookup(k) for k in keys]
            if all(a == Lookup.HIT for a in answers):
                break
            assert Lookup.MISS not in answers, answers
            self.manager.on_schedule_end()
            time.sleep(step_s)
        elapsed = time.perf_counter() - start
        spec = self.manager.prepare_load(keys)  # consume the promise as a load would, then let it go
        if not spec.placed:
            self.workers[0].release(spec.keys, spec.sources)
        self.manager.complete_load(keys)
        self.manager.on_schedule_end()
        return elapsed

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
        for server in self.servers:
            server.close()
        for w in self.workers:
            w.close()
        if self.ranks:
            self.manager.runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="8,64", help="chain lengths (blocks of 16 KiB per rank)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step-ms", type=float, default=1.0, help="time between scheduler steps")
    args = parser.parse_args()
    chains = [int(b) for b in args.blocks.split(",")]
    names = {0: "one process (no channel)", 1: "split, 1 rank", 2: "split, 2 ranks"}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-stage-") as tmp:
        setups = {r: Setup(r, Path(tmp)) for r in names}
        times: dict[tuple[int, int], list[float]] = {}
        try:
            salt = 0
            for round_ in range(args.rounds):
                for n in chains:
                    order = list(names)[round_ % 3:] + list(names)[:round_ % 3]  # rotate who goes first
                    for r in order:
                        salt += 1
                        keys = keys_of(n, salt)
                        setups[r].fill(keys)
                        times.setdefault((r, n), []).append(setups[r].measure(keys, args.step_ms / 1000))
        finally:
            for s in setups.values():
                s.close()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) · {args.rounds} rounds · step {args.step_ms} ms")
    print(f"{'configuration':<28}{'blocks':>7}{'first lookup → HIT, ms (median, min–max)':>44}")
    for n in chains:
        for r, name in names.items():
            t = [x * 1000 for x in times[(r, n)]]
            print(f"{name:<28}{n:>7}{statistics.median(t):>24.2f}  ({min(t):.2f}–{max(t):.2f})")


if __name__ == "__main__":
    main()
