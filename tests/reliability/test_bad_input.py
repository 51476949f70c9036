"""Bad input, fuzzed with hypothesis: configs, tensors, keys, and stored blocks that lie.

The contract: a bad config fails at load (or build) time with :class:`KVTierConfigError` naming the key
path, and nothing is left running; a bad tensor or key raises ``LayoutMismatch`` or ``TypeError``
before the cache changes any state (no pin, no half-written entry), and the cache keeps working; a
stored block whose header claims another key, another layout or an impossible length is a miss, and
nothing is allocated from that length before it is validated.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import socket
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier import BlockKey, KVTierConfigError, LayoutMismatch, TieredCache, load_config
from kvtier.codec import HEADER_SIZE
from kvtier.tiers.file import FileTier
from kvtier.tiers.redis import RedisTier
from tests.helpers import SMALL_MODEL
from tests.reliability.conftest import (
    BLOCK,
    CORRUPTIONS,
    LAYOUT,
    FaultProxy,
    blocks_for,
    cache_config,
    consistency_problems,
    corrupt_bytes,
    expected_bytes,
    forged_value,
    universe,
)

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def round_trip_works(cache: TieredCache, tag: str) -> bool:
    keys = universe(2, tag=tag)
    if cache.store(keys, blocks_for(keys)) != 2:
        return False
    out = torch.empty((2, *LAYOUT.shape), dtype=LAYOUT.dtype)
    return cache.load(keys, out) == 2 and torch.equal(out.view(torch.uint8).reshape(2, -1)[1],
                                                      expected_bytes(keys[1]))


# --- configs ------------------------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12),
                    st.sampled_from(["8GiB", "12 bananas", "-1", "0", "1e400", "fp8", "lz4",
                                     "redis://127.0.0.1:1/0", "${KVTIER_UNSET_VARIABLE}",
                                     "write_through", "second_sighting", "HND", "cpu",
                                     "file", "redis", "gpu", "1TiB"]))
VALUES = st.recursive(SCALARS,
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _mutate(cfg: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(cfg)))
        parent: Any = cfg
        for part in path[:-1]:
            parent = parent[part]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = data.draw(VALUES)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "delete" and isinstance(parent, list) and len(parent) > 1:
            parent.pop(path[-1])
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=10))] = data.draw(VALUES)
    return cfg


def test_fuzzed_configs_fail_at_load_or_build_with_a_key_path(tmp_path: Path) -> None:
    base = {"model": dict(SMALL_MODEL), "hash_block_size": 16, "block_size": 16,
            "groups": [{"block_size": 16, "name": "full"}],
            "tiers": [{"type": "cpu", "capacity": "64KiB", "eviction": "lru"},
                      {"type": "file", "path": str(tmp_path / "fuzz"), "capacity": 8 * BLOCK,
                       "compression": "lz4"},
                      {"type": "redis", "url": "redis://127.0.0.1:1/0", "timeout": 0.2,
                       "connect_timeout": 0.2}],
            "placement": {"write_mode": "write_back", "promote_to": 0}}
    outcomes = {"loaded and built": 0, "refused at load": 0, "refused at build": 0}

    @FUZZ
    @given(st.data())
    def check(data: st.DataObject) -> None:
        cfg = _mutate(base, data)
        try:
            loaded = load_config(cfg)
        except KVTierConfigError as exc:
            assert str(exc), "an empty error message"
            outcomes["refused at load"] += 1
            return
        threads = threading.active_count()
        try:
            cache = TieredCache.from_config(loaded)
        except KVTierConfigError:
            outcomes["refused at build"] += 1
            assert threading.active_count() <= threads + 4  # file tier I/O threads of a half-built cache
            return
        with cache:
            outcomes["loaded and built"] += 1
            if cache.spec.groups and cache.spec.groups[0].layout == LAYOUT:
                cache.lookup(universe(2, tag="fuzz"))

    check()
    assert outcomes["loaded and built"] and outcomes["refused at load"], outcomes


@FUZZ
@given(st.text(max_size=200))
@example("a: 2001-13-01")  # a YAML date that resolves but cannot be built
@example("model: !!binary ===")
def test_fuzzed_yaml_text_loads_or_fails_with_a_config_error(text: str) -> None:
    with contextlib.suppress(KVTierConfigError):
        load_config(text)


def test_metrics_port_in_use_is_a_config_error_and_nothing_keeps_running() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = cache_config()
        cfg["metrics"] = {"port": taken.getsockname()[1]}
        before = {t.ident for t in threading.enumerate()}
        with pytest.raises(KVTierConfigError, match=r"^metrics\.port: .*in use"):
            TieredCache.from_config(cfg)
        assert {t.ident for t in threading.enumerate()} <= before


def test_host_memory_the_machine_cannot_map_is_a_config_error() -> None:
    cfg = cache_config()
    cfg["tiers"][0]["capacity"] = "1000TiB"
    with pytest.raises(KVTierConfigError, match=r"^tiers\[0\]\.capacity: cannot reserve"):
        TieredCache.from_config(cfg)


# --- tensors ------------------------------------------------------------------------------------------------
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16]


@st.composite
def tensor_inputs(draw: st.DrawFn) -> tuple[Any, bool, int]:
    """(blocks argument, whether it is valid, number of keys)."""
    n = draw(st.integers(0, 3))
    keys_n = n if draw(st.booleans()) else draw(st.integers(0, 4))
    shape = [n, *LAYOUT.shape]
    change = draw(st.sampled_from(["none", "drop", "add", "resize", "scalar"]))
    if change == "drop" and len(shape) > 1:
        shape.pop(draw(st.integers(0, len(shape) - 1)))
    elif change == "add":
        shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(1, 2)))
    elif change == "resize":
        i = draw(st.integers(1, len(shape) - 1))
        shape[i] = draw(st.sampled_from([1, shape[i] - 1, shape[i] + 1, shape[i] * 2]))
    elif change == "scalar":
        shape = []
    dtype = draw(st.sampled_from([LAYOUT.dtype] * 3 + DTYPES))
    device = draw(st.sampled_from(["cpu"] * 4 + ["meta"]))
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    layout = draw(st.sampled_from(["as is", "transposed", "every other"]))
    if layout == "transposed" and tensor.dim() >= 3 and tensor.shape[-1] > 1 and tensor.shape[-2] > 1:
        tensor = torch.zeros([*shape[:-2], shape[-1], shape[-2]], dtype=dtype,
                             device=device).transpose(-1, -2)
    elif layout == "every other" and tensor.dim() >= 2 and shape[-1] > 1:
        tensor = torch.zeros([*shape[:-1], shape[-1] * 2], dtype=dtype, device=device)[..., ::2]
    else:
        layout = "as is"
    valid = (change == "none" and dtype == LAYOUT.dtype and device == "cpu" and layout == "as is"
             and keys_n == n)
    form = draw(st.sampled_from(["tensor", "tensor", "list", "junk"]))
    if form == "list" and tensor.dim() >= 1:
        blocks: Any = list(tensor.unbind(0))
        if blocks and draw(st.booleans()):
            blocks[draw(st.integers(0, len(blocks) - 1))] = draw(st.sampled_from(
                [None, 3, "block", np.zeros(LAYOUT.shape, dtype=np.float16), torch.zeros(LAYOUT.shape)]))
            valid = False
        return blocks, valid, keys_n
    if form == "junk":
        junk = [None, 7, "blocks", [1, 2], np.zeros((n, *LAYOUT.shape), dtype=np.float16)]
        return draw(st.sampled_from(junk)), False, keys_n
    return tensor, valid, keys_n


def test_fuzzed_tensors_are_refused_before_any_state_changes(tmp_path: Path) -> None:
    cfg = cache_config(file_dir=tmp_path / "files", cpu_blocks=2, file_blocks=4, write_mode="write_through")
    refused = 0
    with TieredCache.from_config(cfg) as cache:
        meta = torch.zeros((1, *LAYOUT.shape), dtype=LAYOUT.dtype, device="meta")

        @FUZZ
        @given(tensor_inputs(), st.sampled_from(["store", "load"]))
        @example((meta, False, 1), "store")  # right shape and dtype, but no data: caught before planning
        @example((meta, False, 1), "load")
        @example(([meta[0]], False, 1), "store")
        def check(case: tuple[Any, bool, int], op: str) -> None:
            nonlocal refused
            blocks, valid, keys_n = case
            keys = universe(keys_n, tag="tensor-fuzz")
            try:
                getattr(cache, op)(keys, blocks)
            except (LayoutMismatch, TypeError):
                refused += 1
                assert not valid, "a valid call was refused"
            else:
                assert valid or keys_n == 0, f"{op} accepted {type(blocks).__name__} for {keys_n} keys"
            assert consistency_problems(cache) == []

        check()
        assert round_trip_works(cache, "after-tensor-fuzz")
        assert consistency_problems(cache) == []
    assert refused > 20


def test_a_tier_refusing_buffers_after_planning_leaves_nothing_half_done(tmp_path: Path) -> None:
    cfg = cache_config(file_dir=tmp_path / "files", cpu_blocks=2, file_blocks=4, write_mode="write_through")
    with TieredCache.from_config(cfg) as cache:
        file_tier = cache.core.tiers[1]

        async def refuse(keys: Any, blocks: Any) -> list[bool]:
            raise LayoutMismatch("blocks for file tier 'file' must be in host memory")

        file_tier.put = refuse  # type: ignore[method-assign]
        keys = universe(3, tag="refused")
        with pytest.raises(LayoutMismatch):
            cache.store(keys, blocks_for(keys))
        assert consistency_problems(cache) == []
        del file_tier.put
        assert round_trip_works(cache, "after-refusal")


# --- keys ---------------------------------------------------------------------------------------------------
HASHES = st.one_of(st.binary(min_size=0, max_size=100), st.text(max_size=8), st.integers(), st.none(),
                   st.binary(min_size=1, max_size=64))
GROUPS = st.one_of(st.integers(-2, 3), st.booleans(), st.text(max_size=2), st.none(), st.just(0))


@st.composite
def key_inputs(draw: st.DrawFn) -> tuple[Any, bool]:
    kind = draw(st.sampled_from(["key", "key", "key", "tuple", "junk"]))
    block_hash, group = draw(HASHES), draw(GROUPS)
    if kind == "tuple":
        return (block_hash, group), False
    if kind == "junk":
        return draw(st.sampled_from([None, 3, "key", b"\x00" * 16])), False
    valid = type(block_hash) is bytes and 0 < len(block_hash) <= 64 and type(group) is int and group == 0
    return BlockKey(block_hash, group), valid


def test_fuzzed_keys_are_refused_before_any_state_changes(tmp_path: Path) -> None:
    cfg = cache_config(file_dir=tmp_path / "files", cpu_blocks=2, file_blocks=4, write_mode="write_through")
    with TieredCache.from_config(cfg) as cache:
        @FUZZ
        @given(st.lists(key_inputs(), min_size=1, max_size=3), st.sampled_from(["store", "load", "lookup"]))
        def check(cases: list[tuple[Any, bool]], op: str) -> None:
            keys = [k for k, _ in cases]
            valid = all(v for _, v in cases) and len(set(keys)) == len(keys)
            blocks = torch.zeros((len(keys), *LAYOUT.shape), dtype=LAYOUT.dtype)
            try:
                if op == "lookup":
                    cache.lookup(keys)
                else:
                    getattr(cache, op)(keys, blocks)
            except (LayoutMismatch, TypeError):
                assert not valid, f"valid keys were refused: {keys}"
            else:
                assert valid or all(v for _, v in cases), f"{op} accepted {keys!r:.200}"
            assert consistency_problems(cache) == []

        check()
        assert round_trip_works(cache, "after-key-fuzz")
        assert consistency_problems(cache) == []


# --- stored blocks that lie ---------------------------------------------------------------------------------
def test_forged_and_damaged_files_are_misses_at_start_and_on_read(tmp_path: Path) -> None:
    """Every kind of damage, planted once before a restart (start-up's scan must drop it) and once under
    a running tier (the read must); a header claiming 2**40 bytes allocates nothing; a 1 TiB sparse
    file is judged by its size without being read."""
    import random

    rng = random.Random(0)
    kinds = [*CORRUPTIONS, "sparse_huge"]
    keys = universe(2 * len(kinds), tag="forged-files")
    tier = FileTier("file", {0: LAYOUT}, {0: 1 << 30}, root=tmp_path, namespace="forged")
    fingerprint = tier._fingerprints[0]
    assert asyncio.run(tier.put(keys, [expected_bytes(k) for k in keys])) == [True] * len(keys)

    def damage(key: BlockKey, kind: str) -> None:
        path = tier.path_of(key)
        if kind == "sparse_huge":
            os.truncate(path, 1 << 40)
            return
        path.write_bytes(corrupt_bytes(path.read_bytes(), kind, key, rng, fingerprint, header_end=4096))

    at_rest, live = keys[:len(kinds)], keys[len(kinds):]
    for key, kind in zip(at_rest, kinds, strict=True):
        damage(key, kind)
    asyncio.run(tier.close())
    tracemalloc.start()
    again = FileTier("file", {0: LAYOUT}, {0: 1 << 30}, root=tmp_path, namespace="forged")
    try:
        survivors = set(again.keys()) & set(at_rest)
        # start-up reads the header page and the size only: a flipped bit in the payload, or in the
        # header's checksum or reserved bytes, passes it — and fails the checksum on the first read
        assert survivors <= {at_rest[kinds.index("flip_payload")], at_rest[kinds.index("flip_header")]}
        for key, kind in zip(live, kinds, strict=True):
            damage(key, kind)
        out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
        hits = asyncio.run(again.get(keys, out))
        _, peak = tracemalloc.get_traced_memory()
        # a live file grown to 1 TiB still starts with its intact block: the tier reads the size it
        # indexed, the checksum passes, and the bytes are right — a hit is fine, a wrong byte is not
        grown = len(at_rest) + kinds.index("sparse_huge")
        assert hits[:grown] + hits[grown + 1:] == [False] * (len(keys) - 1)
        assert not hits[grown] or torch.equal(out[grown], expected_bytes(keys[grown]))
        assert set(again.keys()) <= {keys[grown]}
        assert peak < 16 << 20, f"{peak} bytes allocated while reading forged blocks"
    finally:
        tracemalloc.stop()
        asyncio.run(again.close())


def test_forged_and_damaged_redis_values_are_misses(redis_servers: Any) -> None:
    import random

    import redis

    server = redis_servers()
    rng = random.Random(1)
    tier = RedisTier("redis", {0: LAYOUT}, namespace="forged", url=server.url, timeout=1.0)
    keys = universe(len(CORRUPTIONS), tag="forged-values")
    client = redis.Redis.from_url(server.url)
    try:
        assert asyncio.run(tier.put(keys, [expected_bytes(k) for k in keys])) == [True] * len(keys)
        fingerprint = tier._fingerprints[0]
        for key, kind in zip(keys, CORRUPTIONS, strict=True):
            rkey = tier.redis_key(key)
            client.set(rkey, corrupt_bytes(client.get(rkey), kind, key, rng, fingerprint))
        client.set(tier.redis_key(keys[0]), forged_value(keys[0], b"\0" * 64, layout_fp=fingerprint,
                                                          raw_len=1 << 40, payload_len=64))
        out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
        tracemalloc.start()
        try:
            hits = asyncio.run(tier.get(keys, out))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert hits == [False] * len(keys)
        assert peak < 16 << 20, f"{peak} bytes allocated while reading forged values"
        assert sum(client.exists(tier.redis_key(k)) for k in keys) == 0  # invalid values are deleted
    finally:
        client.close()
        asyncio.run(tier.close())


class _LyingServer:
    """Answers every command with a bulk string header claiming ``claimed`` bytes, then goes quiet."""

    def __init__(self, claimed: int, header: bytes = b"") -> None:
        self.claimed = claimed
        self.header = header
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.1)
        conns = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                if self._listener.fileno() < 0:
                    break
                continue
            conns.append(conn)
            try:
                conn.recv(65536)
                conn.sendall(b"$%d\r\n" % self.claimed + self.header)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=2)


def test_a_server_claiming_a_huge_value_allocates_nothing_and_times_out() -> None:
    key = universe(1, tag="lying")[0]
    tier = RedisTier("redis", {0: LAYOUT}, namespace="lying", url="redis://127.0.0.1:1/0", timeout=0.3)
    header = forged_value(key, expected_bytes(key).numpy().tobytes(),
                          layout_fp=tier._fingerprints[0])[:HEADER_SIZE]
    server = _LyingServer(1 << 40, header)
    tier = RedisTier("redis", {0: LAYOUT}, namespace="lying", url=f"redis://127.0.0.1:{server.port}/0",
                     timeout=0.3, connect_timeout=0.3)
    try:
        tracemalloc.start()
        started = time.monotonic()
        hits = asyncio.run(tier.get([key], [torch.empty(BLOCK, dtype=torch.uint8)]))
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        asyncio.run(tier.close())
        server.close()
    assert hits == [False]
    assert elapsed < 2.0
    assert peak < 16 << 20, f"{peak} bytes allocated for a value claimed to be 1 TiB"


def test_a_server_answering_exists_with_a_huge_bulk_allocates_nothing() -> None:
    server = _LyingServer(256 << 20)
    tier = RedisTier("redis", {0: LAYOUT}, namespace="lying", url=f"redis://127.0.0.1:{server.port}/0",
                     timeout=0.3, connect_timeout=0.3)
    try:
        tracemalloc.start()
        found = asyncio.run(tier.contains(universe(1, tag="lying-exists")))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        asyncio.run(tier.close())
        server.close()
    assert found == [False]
    assert peak < 16 << 20, f"{peak} bytes allocated for a reply claimed to be 256 MiB"


def test_hung_server_in_front_of_the_fuzzed_calls_still_answers() -> None:
    """Bad keys are refused before any I/O: a dead Redis cannot make a refusal slow."""
    with FaultProxy(None) as hung:
        cfg = cache_config(redis={"url": hung.url, "timeout": 0.3, "connect_timeout": 0.3})
        with TieredCache.from_config(cfg) as cache:
            started = time.monotonic()
            with pytest.raises(TypeError):
                cache.lookup([BlockKey(b"x" * 65, 0)])
            assert time.monotonic() - started < 0.1


def test_file_tier_refuses_an_oversized_hash_before_writing_any_block_of_the_batch(tmp_path: Path) -> None:
    tier = FileTier("file", {0: LAYOUT}, {0: 1 << 30}, root=tmp_path, namespace="ns")
    good = universe(3, tag="batch")
    try:
        with pytest.raises(ValueError, match="at most 64"):
            asyncio.run(tier.put([*good, BlockKey(b"x" * 65, 0)], [expected_bytes(k) for k in good] +
                                 [torch.zeros(BLOCK, dtype=torch.uint8)]))
        assert list(tier.keys()) == [] and not any(tier.directory.rglob("*.kvb"))
    finally:
        asyncio.run(tier.close())


def test_a_file_tier_path_that_cannot_be_a_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(KVTierConfigError, match=r"^tiers\[1\]\.path: cannot use .*a-file/cache"):
        TieredCache.from_config(cache_config(file_dir=tmp_path / "a-file" / "cache"))
