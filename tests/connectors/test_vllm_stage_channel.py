"""Slow tiers with vLLM's workers in processes of their own: the stage channel, without vLLM.

One manager over an index-only runtime talks to one worker runtime per TP rank over real Unix sockets
(:mod:`kvtier.connectors.vllm.stage_channel`); the ranks hold real files (and Redis keys) of their
own. A block is a HIT only once every rank staged it; one rank losing it makes it a MISS.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.blocks import BlockKey
from kvtier.connectors.vllm import (
    KeyCodec,
    KVTierOffloadManager,
    KVTierOffloadWorkerCore,
    Lookup,
    OffloadRuntime,
    kvtier_config_for_engine,
    page_movers,
)
from kvtier.connectors.vllm.stage_channel import StageClient, StageServer, socket_path
from tests.connectors.test_vllm_unit import DIM, HEADS, GpuSpec, geometry, redis_up

NUM_BLOCKS = 16


class Rank:
    """One TP rank's worker: its own tiers (namespace with its rank), KV pages and stage server."""

    def __init__(
        self, tiers: list[dict[str, Any]], rank: int, engine_id: str, model_name: str, size: int = 2
    ) -> None:
        config = kvtier_config_for_engine(
            {"tiers": tiers}, geometry(tp_rank=rank, tp_size=size, model_name=model_name)
        )
        self.runtime = OffloadRuntime(config, KeyCodec([0]))
        gen = torch.Generator().manual_seed(100 + rank)
        page = 2 * 32 * HEADS * DIM * 2
        self.pages = [
            torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen) for _ in range(2)
        ]
        refs = [[SimpleNamespace(tensor_idx=i, page_size_bytes=page) for i in range(2)]]
        caches = SimpleNamespace(
            tensors=[SimpleNamespace(tensor=t) for t in self.pages], group_data_refs=refs
        )
        self.worker = KVTierOffloadWorkerCore(self.runtime, page_movers(caches, self.runtime, 1), 1)
        self.server = StageServer(
            socket_path(engine_id, rank), self.runtime.stage_chains, self.runtime.release_staged
        )

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [layer[block_id].clone() for layer in self.pages]

    def close(self) -> None:
        self.server.close()
        self.worker.shutdown()
        self.runtime.close()


class Engine:
    """vLLM's split: the manager (scheduler process) with a stage client, and the ranks' workers."""

    def __init__(self, tiers_of: Any, tmp_path: Path, ranks: int = 2, timeout: float = 10.0) -> None:
        engine_id = f"test-{tmp_path.name}-{os.getpid()}"
        model_name = f"stage-{tmp_path.name}-{os.getpid()}"
        self.ranks = [Rank(tiers_of(r), r, engine_id, model_name, ranks) for r in range(ranks)]
        config = kvtier_config_for_engine(
            {"tiers": tiers_of(0)}, geometry(model_name=model_name, tp_size=ranks)
        )
        self.stage = StageClient([socket_path(engine_id, r) for r in range(ranks)], timeout)
        self.manager = KVTierOffloadManager(
            OffloadRuntime(config, KeyCodec([0]), index_only=True), stage=self.stage
        )
        self._jobs = itertools.count()

    def close(self) -> None:
        self.stage.close()
        for rank in self.ranks:
            rank.close()
        self.manager.runtime.close()

    def keys(self, n: int, salt: int = 0) -> list[bytes]:
        return [(salt * 1000 + i).to_bytes(32, "little") + (0).to_bytes(4, "big") for i in range(n)]

    def run(self, submit: str, *args: Any) -> list[bool]:
        """The same job on every rank (vLLM sends each worker the same metadata); each rank's success."""
        outcomes = []
        for rank in self.ranks:
            job = next(self._jobs)
            assert getattr(rank.worker, submit)(job, *args)
            rank.worker.wait({job})
            outcomes.append(bool(rank.worker.get_finished()[0]["success"]))
        return outcomes

    def store(self, keys: list[bytes], block_ids: list[int]) -> list[bytes]:
        planned = self.manager.plan_store(keys)
        assert planned is not None
        chosen, spec = planned
        if chosen:
            ids = [block_ids[keys.index(k)] for k in chosen]
            assert all(self.run("submit_store", GpuSpec(np.array(ids, np.int32), (len(ids),), (0,)), spec))
        self.manager.complete_store(chosen)
        return chosen

    def step(self, keys: list[bytes]) -> list[Any]:
        """One scheduler step of lookups (vLLM stops at the first MISS), then the round they asked for."""
        answers = []
        for key in keys:
            answers.append(self.manager.lookup(key))
            if answers[-1] == Lookup.MISS:
                break
        self.manager.on_schedule_end()
        return answers

    def settle(self, keys: list[bytes]) -> list[Any]:
        """Step until no stage is in flight; the lookups then."""
        first = self.step(keys)
        while self.manager.has_pending_work():
            time.sleep(0.01)
        assert first
        return self.step(keys)

    def load(self, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        spec = self.manager.prepare_load(keys)
        outcomes = self.run(
            "submit_load", spec, GpuSpec(np.array(block_ids, np.int32), (len(block_ids),), (0,))
        )
        self.manager.complete_load(keys)
        return outcomes

    def wait_released(self) -> None:
        """Step until every rank dropped its staged copies (releases travel with the next round)."""
        for _ in range(500):
            self.manager.on_schedule_end()
            if all(len(rank.runtime.staging) == 0 for rank in self.ranks):
                return
            time.sleep(0.01)
        raise AssertionError([len(rank.runtime.staging) for rank in self.ranks])


def file_tiers(tmp_path: Path) -> Any:
    return lambda rank: [{"type": "file", "path": str(tmp_path / "nvme"), "capacity": "4MiB"}]


def test_a_file_block_is_a_hit_once_every_rank_staged_it_and_each_rank_loads_its_own_bytes(
    tmp_path: Path,
) -> None:
    engine = Engine(file_tiers(tmp_path), tmp_path)
    try:
        keys = engine.keys(3)
        expected = [[rank.block(b) for b in (1, 2, 3)] for rank in engine.ranks]
        assert engine.store(keys, [1, 2, 3]) == keys
        assert (
            engine.step(keys) == [Lookup.HIT_PENDING] * 3
        )  # in the file tier: staged first, never read directly
        assert engine.settle(keys) == [Lookup.HIT] * 3
        assert all(len(rank.runtime.staging) == 3 for rank in engine.ranks)  # staged and pinned on every rank
        assert engine.stage.rounds >= 1
        assert engine.load(keys, [7, 8, 9]) == [True, True]
        for rank, want in zip(engine.ranks, expected, strict=True):  # each rank got its own heads back
            for block_id, exp in zip((7, 8, 9), want, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(rank.block(block_id), exp, strict=True))
        assert [rank.runtime.stats().tiers[0].hits for rank in engine.ranks] == [3, 3]
        engine.wait_released()  # loaded: the staged copies go on every rank
        assert engine.step(keys[:1]) == [Lookup.HIT_PENDING]  # and a later lookup stages again
    finally:
        engine.close()


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_a_block_lost_on_one_rank_is_a_miss_and_leaves_the_index(tmp_path: Path, damage: str) -> None:
    engine = Engine(file_tiers(tmp_path), tmp_path)
    try:
        keys = engine.keys(3)
        assert engine.store(keys, [1, 2, 3]) == keys
        file_tier = engine.ranks[1].runtime.core.tiers[0]
        path = Path(file_tier.path_of(BlockKey(engine.manager._codec.block_key(keys[1]).block_hash, 0)))
        assert path.is_file()
        if damage == "delete":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))

        assert engine.settle(keys) == [Lookup.HIT, Lookup.MISS]  # rank 1 lost the second block: recompute it
        removed = engine.manager.take_removed()
        assert removed == [keys[1]]  # reported to vLLM as gone
        assert engine.manager.counters.lost_blocks == 1
        assert engine.manager._residency.locate(engine.manager._codec.block_key(keys[1])) is None
        assert engine.load(keys[:1], [7]) == [True, True]  # the first block is still a hit on both ranks
        engine.wait_released()  # rank 0's copies of blocks 2 and 3, never promised, were released too
        other = engine.keys(1, salt=1)
        assert engine.store(other, [4]) == other  # the next plan deletes rank 0's copy of the lost block
        rank0_path = Path(
            engine.ranks[0].runtime.core.tiers[0].path_of(engine.manager._codec.block_key(keys[1]))
        )
        assert not rank0_path.exists()
        if damage == "corrupt":
            assert engine.ranks[1].runtime.stats().tiers[0].corrupt_or_lost == 1
    finally:
        engine.close()


def test_a_rank_that_does_not_answer_makes_a_miss_never_a_hang(tmp_path: Path) -> None:
    engine_id = f"mute-{tmp_path.name}-{os.getpid()}"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(socket_path(engine_id, 1))
    mute.listen(1)  # accepts connections, never answers
    try:
        rank0 = Rank(file_tiers(tmp_path)(0), 0, engine_id, f"mute-{tmp_path.name}")
        client = StageClient([socket_path(engine_id, 0), socket_path(engine_id, 1)], timeout=0.5)
        try:
            chain = [BlockKey(b"\x01" * 40, 0)]
            (future,) = client.submit([chain])
            result = future.result(timeout=30)
            assert (result.staged, result.lost) == (0, False)
            assert client.timeouts == 1
        finally:
            client.close()
            rank0.close()
    finally:
        mute.close()
        os.unlink(socket_path(engine_id, 1))


def test_an_unreachable_rank_makes_a_miss(tmp_path: Path) -> None:
    client = StageClient([str(tmp_path / "nobody.sock")], timeout=0.5)
    try:
        (future,) = client.submit([[BlockKey(b"\x02" * 40, 0)]])
        assert future.result(timeout=30).staged == 0
    finally:
        client.close()


def test_a_stage_server_refuses_a_socket_another_worker_serves(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    first = StageServer(path, lambda chains: [(0, False)] * len(chains), lambda keys: None)
    try:
        with pytest.raises(OSError, match="another kvtier worker serves"):
            StageServer(path, lambda chains: [], lambda keys: None)
    finally:
        first.close()
    second = StageServer(path, lambda chains: [], lambda keys: None)  # a closed server's path is free again
    second.close()


def test_a_reset_releases_promises_and_stages_in_flight(tmp_path: Path) -> None:
    engine = Engine(file_tiers(tmp_path), tmp_path)
    try:
        keys = engine.keys(3)
        assert engine.store(keys, [1, 2, 3]) == keys
        assert engine.settle(keys) == [Lookup.HIT] * 3
        engine.manager.reset_cache()
        engine.wait_released()
        assert engine.settle(keys) == [Lookup.MISS]  # a fresh epoch: nothing stored before is served
    finally:
        engine.close()


@pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")
def test_redis_blocks_answer_retry_then_hit_on_every_rank(tmp_path: Path) -> None:
    def tiers(rank: int) -> list[dict[str, Any]]:
        return [{"type": "redis", "url": "redis://127.0.0.1:6379/0", "ttl_seconds": 60}]

    engine = Engine(tiers, tmp_path)
    try:
        keys = engine.keys(2)
        expected = [[rank.block(b) for b in (1, 2)] for rank in engine.ranks]
        assert engine.store(keys, [1, 2]) == keys
        assert engine.step(keys) == [Lookup.RETRY] * 2  # Redis is asked by every rank
        assert engine.settle(keys) == [Lookup.HIT] * 2
        assert engine.load(keys, [5, 6]) == [True, True]
        for rank, want in zip(engine.ranks, expected, strict=True):
            for block_id, exp in zip((5, 6), want, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(rank.block(block_id), exp, strict=True))
        assert [rank.runtime.stats().tiers[0].hits for rank in engine.ranks] == [2, 2]
        unknown = engine.keys(1, salt=9)
        assert engine.settle(unknown) == [Lookup.MISS]
    finally:
        engine.close()


def test_a_block_stored_again_while_its_stage_is_asked_for_leaves_no_pinned_copy(tmp_path: Path) -> None:
    engine = Engine(file_tiers(tmp_path), tmp_path)
    try:
        keys = engine.keys(2)
        assert engine.store(keys, [1, 2]) == keys
        for key in keys:  # the ranks' files, unknown to this manager (as another server's files are)
            engine.manager._residency.forget(0, engine.manager._codec.block_key(key))
        assert [engine.manager.lookup(k) for k in keys] == [Lookup.RETRY] * 2  # queued for this step
        planned = engine.manager.plan_store(keys)  # another request computed and stores them meanwhile
        assert planned is not None and planned[0] == keys
        engine.manager.on_schedule_end()  # the round still stages them on the ranks: staged for nobody
        while engine.stage.rounds < 1:
            time.sleep(0.01)
        engine.manager.complete_store(planned[0])
        engine.wait_released()
        assert all(not rank.runtime.staging._pins for rank in engine.ranks)
    finally:
        engine.close()
