"""Races the stress scenarios found, replayed deterministically.

Each test holds a tier call at a gate (an ``asyncio.Event``) to force the interleaving the stress runs
hit by chance, then checks the state: no pin left, the cache's index equal to what the tiers hold, and
every block exact or missing.

- A load that located a block, then waited for a remote tier, must not act on the stale location
  (it read an evicted copy, and its "miss" forgot a newer write of the same key: a pin leaked).
- A key that a load still has pinned in a tier is never written into that tier (docs/architecture.md#pins): a
  demotion used to write it there, and the load's late "miss" then forgot the new copy.
- A read that fails with EIO leaves the block where it is, indexed, for a later retry
  (docs/architecture.md#failure-contract): the cache used to forget it while the file tier kept it.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier import AsyncTieredCache, BlockKey
from kvtier.config import build_cache_parts, load_config
from kvtier.tiers.base import Tier
from tests.reliability.conftest import (
    BLOCK,
    LAYOUT,
    SyscallFaults,
    blocks_for,
    cache_config,
    expected_bytes,
    universe,
)


class MemoryRemote(Tier):
    """A self-evicting tier in a dict (a stand-in for Redis), whose ``contains`` can be held at a gate."""

    kind = "redis"
    self_evicting = True

    def __init__(self) -> None:
        super().__init__("redis", {0: LAYOUT}, {0: 0})
        self.values: dict[BlockKey, bytes] = {}
        self.contains_gate: asyncio.Event | None = None

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        for key, block in zip(keys, blocks, strict=True):
            self.values[key] = block.numpy().tobytes()
        return [True] * len(keys)

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> list[bool]:
        hits = []
        for key, buf in zip(keys, out, strict=True):
            value = self.values.get(key)
            if value is not None:
                buf.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
            hits.append(value is not None)
        return hits

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        if self.contains_gate is not None:
            await self.contains_gate.wait()
        return [key in self.values for key in keys]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.values.pop(key, None)

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self.values))

    def usage_bytes(self) -> int:
        return 0


def build(cfg: dict[str, Any], replace: dict[int, Tier] | None = None) -> AsyncTieredCache:
    spec, tiers, residency, namespace = build_cache_parts(load_config(cfg))
    for t, tier in (replace or {}).items():
        tiers[t] = tier
    return AsyncTieredCache(spec, tiers, residency, namespace)


def hold(method: Callable[..., Awaitable[Any]], gate: Callable[[Sequence[BlockKey]], asyncio.Event | None], *,
         after: bool = False) -> Callable[..., Awaitable[Any]]:
    """Wrap a tier method: when ``gate(keys)`` gives an event, wait for it before (or after) the call."""
    async def held(keys: Sequence[BlockKey], *args: Any) -> Any:
        event = gate(keys)
        if event is not None and not after:
            await event.wait()
        result = await method(keys, *args)
        if event is not None and after:
            await event.wait()
        return result
    return held


async def settle(*tasks: asyncio.Task[Any]) -> None:
    """Let the loop run until every task is blocked at a gate (or done)."""
    for _ in range(200):
        await asyncio.sleep(0.005)
        if all(t.done() or t._fut_waiter is not None for t in tasks):  # type: ignore[attr-defined]
            return


def leftovers(core: AsyncTieredCache) -> list[str]:
    problems = []
    for tier, index in zip(core.tiers, core.residency.tiers, strict=True):
        if index.self_evicting:
            continue
        if index.pins:
            problems.append(f"{tier.name}: pins left {dict(index.pins)}")
        if set(tier.keys()) != set(index.entries):
            problems.append(f"{tier.name}: tier holds {len(set(tier.keys()))} keys, "
                            f"index lists {len(index.entries)}")
    return problems


def out_for(n: int) -> torch.Tensor:
    return torch.empty((n, *LAYOUT.shape), dtype=LAYOUT.dtype)


def exact(out: torch.Tensor, keys: Sequence[BlockKey], n: int) -> bool:
    rows = out.view(torch.uint8).reshape(len(keys), -1)
    return all(torch.equal(rows[i], expected_bytes(keys[i])) for i in range(n))


def test_load_does_not_act_on_a_location_that_went_stale_while_it_waited_for_redis() -> None:
    remote = MemoryRemote()
    core = build(cache_config(cpu_blocks=2, redis={"url": "redis://127.0.0.1:1/0"}), {1: remote})
    cpu = core.tiers[0]
    k, x, a, b = universe(4, tag="stale-location")
    put_gate: dict[str, asyncio.Event] = {}
    cpu.put = hold(cpu.put, lambda keys: put_gate.get("k") if k in keys else None)  # type: ignore[method-assign]

    async def scenario() -> None:
        await core.start()
        assert await core.store([k], blocks_for([k])) == 1
        remote.contains_gate = asyncio.Event()
        out = out_for(2)
        load = asyncio.create_task(core.load([k, x], out))  # k is in the CPU tier; x: ask Redis (held)
        await settle(load)
        await core.store([a, b], blocks_for([a, b]))  # k is evicted from the CPU tier, demoted to Redis
        put_gate["k"] = asyncio.Event()
        # k is written to the CPU tier again (held)
        store = asyncio.create_task(core.store([k], blocks_for([k])))
        await settle(load, store)
        remote.contains_gate.set()
        n = await load
        put_gate["k"].set()
        assert await store == 1
        assert exact(out, [k, x], n)
        assert leftovers(core) == []
        out1 = out_for(1)
        assert await core.load([k], out1) == 1 and exact(out1, [k], 1)
        await core.close()

    asyncio.run(scenario())


def test_a_key_pinned_by_a_load_is_not_written_into_that_tier(tmp_path: Path) -> None:
    core = build(cache_config(file_dir=tmp_path / "files", cpu_blocks=1, file_blocks=4))
    file_tier = core.tiers[1]
    k, y, z = universe(3, tag="pinned-write")
    get_gates: list[asyncio.Event] = []
    put_gate: dict[str, asyncio.Event] = {}

    def next_get_gate(keys: Sequence[BlockKey]) -> asyncio.Event | None:
        return get_gates.pop(0) if k in keys and get_gates else None

    file_tier.get = hold(file_tier.get, next_get_gate, after=True)  # type: ignore[method-assign]
    file_tier.put = hold(file_tier.put, lambda keys: put_gate.get("k") if k in keys else None)  # type: ignore[method-assign]

    async def scenario() -> None:
        await core.start()
        await core.store([k], blocks_for([k]))
        await core.store([y], blocks_for([y]))  # k demoted into the file tier
        assert core.residency.locate(k) == 1
        file_tier.path_of(k).unlink()  # deleted under the tier's feet: both loads below will miss
        gates = [asyncio.Event(), asyncio.Event()]
        get_gates.extend(gates)
        first = asyncio.create_task(core.load([k], out_for(1)))
        second = asyncio.create_task(core.load([k], out_for(1)))
        await settle(first, second)
        gates[0].set()
        assert await first == 0  # k forgotten in the file tier; the second load still pins it there
        await core.store([k], blocks_for([k]))  # k back in the CPU tier, y demoted
        put_gate["k"] = asyncio.Event()
        evict = asyncio.create_task(core.store([z], blocks_for([z])))  # evicts k from the CPU tier
        await settle(evict, second)
        gates[1].set()
        assert await second == 0
        put_gate["k"].set()
        assert await evict == 1
        assert leftovers(core) == []
        out = out_for(1)
        n = await core.load([k], out)
        assert exact(out, [k], n)
        await core.close()

    asyncio.run(scenario())


def test_eio_on_read_keeps_the_block_for_a_retry(tmp_path: Path) -> None:
    core = build(cache_config(file_dir=tmp_path / "files", cpu_blocks=1, file_blocks=4))
    k, y = universe(2, tag="eio-keeps")

    async def scenario() -> None:
        await core.start()
        await core.store([k], blocks_for([k]))
        await core.store([y], blocks_for([y]))  # k demoted into the file tier
        with SyscallFaults() as faults:
            faults.set("preadv", errno.EIO, 1.0)
            assert await core.load([k], out_for(1)) == 0  # a miss …
        assert leftovers(core) == []  # … that keeps k indexed where it is
        assert await core.lookup([k]) == 1
        out = out_for(1)
        assert await core.load([k], out) == 1 and exact(out, [k], 1)  # the retry reads it
        assert core.stats().tiers[1].usage_bytes == BLOCK * len(list(core.tiers[1].keys()))
        await core.close()

    asyncio.run(scenario())
