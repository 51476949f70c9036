"""RedisTier against real servers on loopback: the shared 127.0.0.1:6379, private servers and clusters.

Fixtures (tests/tiers/conftest.py) skip these tests without Redis, or fail them when ``CI`` is set.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import redis
except ImportError:  # the `redis` extra is missing
    if os.environ.get("CI"):
        raise
    pytest.skip("redis-py is not installed: pip install 'kvtier[redis]'", allow_module_level=True)

from redis.crc import key_slot

from kvtier.blocks import BlockKey
from kvtier.codec import HEADER_SIZE, encode_block
from kvtier.errors import LayoutMismatch
from kvtier.kernels import host
from kvtier.layout import BlockLayout
from kvtier.tiers.redis import CircuitBreaker, CircuitBreakerConfig, RedisTier
from tests.tiers.conftest import make_test_certificates

#: 16 KiB blocks keep most tests fast; one test moves 2 MiB blocks.
SMALL = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
#: Same bytes per block as SMALL, another layout (another fingerprint).
SMALL_OTHER = BlockLayout(num_layers=4, num_kv_heads=1, head_dim=64, block_size=16)
LARGE = BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def keys_for(n: int, group: int = 0) -> list[BlockKey]:
    return [BlockKey(os.urandom(32), group) for _ in range(n)]


def kv_like(layout: BlockLayout, n: int, seed: int = 0) -> list[torch.Tensor]:
    """Random-normal fp16 blocks as 1-D uint8 tensors (what the cache hands a tier)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.nbytes // 2, generator=gen).half().view(torch.uint8) for _ in range(n)]


def compressible(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    """fp16 blocks of few distinct values: lz4 shrinks them, so the compressed path runs."""
    return [(torch.arange(layout.nbytes // 2) % 7 + i).half().view(torch.uint8) for i in range(n)]


def empty_like_blocks(layout: BlockLayout, n: int) -> list[torch.Tensor]:
    return [torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8) for _ in range(n)]


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


FAST_BREAKER = CircuitBreakerConfig(failures=2, cooldown_seconds=0.3)


MakeTier = Callable[..., RedisTier]


@pytest.fixture(autouse=True, params=["native client", "python client"])
def client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: raw GETs and SETs through the native helper (kvtier/kernels/redisio.c),
    and with the helper reported missing (every request through the Python client)."""
    if request.param == "native client":
        if not host.redis_available():
            pytest.skip(f"the native helper is unavailable: {host.unavailable_reason}")
    else:
        monkeypatch.setattr(host, "redis_available", lambda: False)
    return str(request.param)


@pytest.fixture()
def make_tier() -> Iterator[MakeTier]:
    """``RedisTier(…)`` that is closed (idle connections, I/O threads) when the test ends."""
    made: list[RedisTier] = []

    def make(*args: Any, **kwargs: Any) -> RedisTier:
        made.append(RedisTier(*args, **kwargs))
        return made[-1]

    yield make
    for tier in made:
        asyncio.run(tier.close())


# --- configuration and the breaker (no server) -----------------------------------------------------------
def test_constructor_derives_the_connection_from_validated_settings() -> None:
    """The settings were validated by kvtier.config (tests/test_config.py); the tier only derives."""
    with pytest.raises(ValueError, match="namespace"):
        RedisTier("r", {0: SMALL}, namespace="has space")
    with pytest.raises(ValueError, match="namespace"):
        RedisTier("r", {0: SMALL}, namespace="tag{x}")
    tier = RedisTier("r", {0: SMALL}, namespace="ns", url="rediss://user:p%40ss@example.org:7001/2")
    assert (tier.tls, tier.username, tier.password, tier.db, str(tier.address)) == (
        True, "user", "p@ss", 2, "example.org:7001")
    assert RedisTier("r", {0: SMALL}, namespace="ns", startup_nodes=["10.0.0.1:7000"]).cluster
    assert tier.redis_key(BlockKey(b"\x01\xab", 3)) == b"kvtier:ns:3:01ab"


def test_tiers_never_import_the_config() -> None:
    """kvtier.config builds tiers; a tier that imported it back would close a circle (and validate twice)."""
    import ast

    import kvtier.tiers.base

    root = Path(kvtier.tiers.base.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and node.module == "kvtier":
                names = [f"kvtier.{a.name}" for a in node.names]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith("kvtier.config")]
    assert offenders == []


def test_slot_table_from_cluster_slots_rows() -> None:
    """CLUSTER SLOTS rows → slot owners: "" is the node that answered, "?" (address unknown) is uncovered."""
    from kvtier.tiers.redis.cluster import SLOTS, _table
    from kvtier.tiers.redis.protocol import Addr

    asked = Addr("10.0.0.9", 7000)
    rows = [[0, 99, [b"10.0.0.1", 7001, b"id1"], [b"10.0.0.4", 7004, b"replica"]],
            [100, 199, [b"", 7002, b"id2"]],
            [200, 299, ["?", 7003, "id3"]],
            [300, SLOTS - 1, ["10.0.0.3", 7003, "id3"]]]
    owner = _table(rows, asked)
    assert owner[0] == owner[99] == Addr("10.0.0.1", 7001)
    assert owner[100] == owner[199] == Addr("10.0.0.9", 7002)
    assert owner[200] is None and owner[299] is None
    assert owner[300] == owner[SLOTS - 1] == Addr("10.0.0.3", 7003) and len(owner) == SLOTS
    assert Addr.parse("[::1]:7000") == Addr("::1", 7000) and Addr.parse("nohost") is None


def test_circuit_breaker_states() -> None:
    now = [0.0]
    breaker = CircuitBreaker(CircuitBreakerConfig(failures=2, cooldown_seconds=5), clock=lambda: now[0])
    assert breaker.allow() and not breaker.failure()
    assert breaker.failure() and breaker.is_open          # the 2nd consecutive failure opens it
    assert not breaker.allow()                            # cooling down
    now[0] = 5.0
    assert breaker.allow() and not breaker.allow()        # one probe at a time
    assert not breaker.failure() and not breaker.allow()  # failed probe: another cool-down
    now[0] = 10.0
    assert breaker.allow() and breaker.success() and not breaker.is_open
    assert breaker.allow() and not breaker.failure()      # closed again: counts from zero


def test_wrong_buffers_raise() -> None:
    tier = RedisTier("r", {0: SMALL}, namespace="ns", url="redis://127.0.0.1:1/0")
    with pytest.raises(LayoutMismatch):
        asyncio.run(tier.get(keys_for(1), [torch.empty(10, dtype=torch.uint8)]))
    with pytest.raises(LayoutMismatch):
        asyncio.run(tier.put(keys_for(1, group=7), kv_like(SMALL, 1)))


# --- single node ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_round_trip_is_bit_exact(redis_url: str, namespace: str, compression: str,
                                  make_tier: MakeTier) -> None:
    tier = make_tier("r", {0: SMALL, 1: LARGE}, namespace=namespace, url=redis_url, compression=compression)
    small_keys, large_keys = keys_for(24), keys_for(6, group=1)
    small = kv_like(SMALL, 12) + compressible(SMALL, 12)
    large = kv_like(LARGE, 3, seed=1) + compressible(LARGE, 3)
    keys, blocks = small_keys + large_keys, small + large
    out = empty_like_blocks(SMALL, 24) + empty_like_blocks(LARGE, 6)

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * len(keys)
        assert await tier.get(keys, out) == [True] * len(keys)
        assert await tier.contains(keys + keys_for(1)) == [True] * len(keys) + [False]
        await tier.close()

    asyncio.run(scenario())
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
    client = sync_client(redis_url)
    sizes = [client.strlen(tier.redis_key(k)) for k in keys]
    client.close()
    if compression == "lz4":  # compressible blocks shrink, random-normal fp16 ones are stored raw
        assert all(s < HEADER_SIZE + SMALL.nbytes for s in sizes[12:24])
        assert all(s == HEADER_SIZE + SMALL.nbytes for s in sizes[:12])
    else:
        assert sizes == [HEADER_SIZE + SMALL.nbytes] * 24 + [HEADER_SIZE + LARGE.nbytes] * 6
    assert tier.counters.errors == {}
    assert tier.counters.blocks_written == tier.counters.blocks_read == len(keys)

    # Closed, then used from another event loop: it reconnects and reads the same blocks.
    again = empty_like_blocks(SMALL, 24)
    assert asyncio.run(tier.get(small_keys, again)) == [True] * 24
    assert all(torch.equal(a, b) for a, b in zip(small, again, strict=True))


def test_absent_keys_miss_without_errors(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url)
    assert asyncio.run(tier.get(keys_for(5), empty_like_blocks(SMALL, 5))) == [False] * 5
    assert tier.counters.errors == {}


def test_tampered_values_miss_and_are_deleted(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(4), kv_like(SMALL, 4)
    asyncio.run(tier.put(keys, blocks))
    client = sync_client(redis_url)
    good = client.get(tier.redis_key(keys[1]))
    client.set(tier.redis_key(keys[0]), b"garbage")                              # not a kvtier value
    client.set(tier.redis_key(keys[1]), good[:HEADER_SIZE] + b"\x00" + good[HEADER_SIZE + 1:])  # checksum
    client.set(tier.redis_key(keys[2]), client.get(tier.redis_key(keys[3])))    # another key's value
    out = empty_like_blocks(SMALL, 4)
    assert asyncio.run(tier.get(keys, out)) == [False, False, False, True]
    assert [client.exists(tier.redis_key(k)) for k in keys] == [0, 0, 0, 1]
    client.close()
    assert tier.counters.errors == {"corrupt": 3}
    assert torch.equal(out[3], blocks[3])


def test_a_flipped_byte_anywhere_in_a_big_block_is_a_miss(redis_url: str, namespace: str,
                                                           make_tier: MakeTier) -> None:
    """A flipped payload byte early, in the middle or late in a 1 MiB block is a miss; the clean
    blocks around it come back exact."""
    big = BlockLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16)  # 1 MiB
    tier = make_tier("r", {0: big}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(5), kv_like(big, 5, seed=4)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 5
    client = sync_client(redis_url)
    quarter = 256 * 1024
    for k, offset in ((0, quarter - 1), (2, 2 * quarter), (4, 3 * quarter + 12345)):
        good = bytearray(client.get(tier.redis_key(keys[k])))
        good[HEADER_SIZE + offset] ^= 0x40
        client.set(tier.redis_key(keys[k]), bytes(good))
    client.close()
    out = empty_like_blocks(big, 5)
    assert asyncio.run(tier.get(keys, out)) == [False, True, False, True, False]
    assert torch.equal(out[1], blocks[1]) and torch.equal(out[3], blocks[3])
    assert tier.counters.errors == {"corrupt": 3}


def test_long_batches_of_small_blocks_keep_their_places(redis_url: str, namespace: str,
                                                        make_tier: MakeTier) -> None:
    """A long batch shared by the I/O threads: a corrupt value, a short one and a missing key in its
    middle are misses at their own index, every other block comes back exact."""
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url, max_connections=2)
    n = 300
    keys, blocks = keys_for(n), kv_like(SMALL, n, seed=3)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * n
    client = sync_client(redis_url)
    good = client.get(tier.redis_key(keys[150]))
    client.set(tier.redis_key(keys[150]), good[:-1] + bytes([good[-1] ^ 1]))  # checksum mismatch
    client.set(tier.redis_key(keys[151]), b"short")
    client.delete(tier.redis_key(keys[152]))
    client.close()
    out = empty_like_blocks(SMALL, n)
    hits = asyncio.run(tier.get(keys, out))
    assert [i for i, hit in enumerate(hits) if not hit] == [150, 151, 152]
    assert all(torch.equal(out[i], blocks[i]) for i in range(n) if hits[i])
    assert tier.counters.errors == {"corrupt": 2}


#: 256 KiB (one hashing piece) and 320 KiB (a piece and a tail), and a layout with SMALL_256's bytes.
SMALL_256 = BlockLayout(num_layers=32, num_kv_heads=1, head_dim=128, block_size=16)
OTHER_256 = BlockLayout(num_layers=64, num_kv_heads=1, head_dim=64, block_size=16)
ODD_320 = BlockLayout(num_layers=40, num_kv_heads=1, head_dim=128, block_size=16)


@pytest.mark.parametrize("connections", [1, 4])
def test_round_trip_is_bit_exact_at_several_sizes(redis_url: str, namespace: str, connections: int,
                                                  make_tier: MakeTier) -> None:
    """16 KiB, 256 KiB, 320 KiB and 2 MiB blocks in one batch (each size's reply read straight into
    its buffer), on one connection and on several."""
    layouts = {0: SMALL, 1: SMALL_256, 2: ODD_320, 3: LARGE}
    tier = make_tier("r", layouts, namespace=namespace, url=redis_url, max_connections=connections)
    keys = [k for gid in layouts for k in keys_for(3, group=gid)]
    blocks = [b for gid, layout in layouts.items() for b in kv_like(layout, 3, seed=gid)]
    out = [b for layout in layouts.values() for b in empty_like_blocks(layout, 3)]
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 12
    order = list(range(12))[::-1]  # sizes interleaved differently from the put
    assert asyncio.run(tier.get([keys[i] for i in order], [out[i] for i in order])) == [True] * 12
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
    assert tier.counters.errors == {}


@pytest.mark.parametrize("depth", [1, 8])
def test_one_connection_stays_in_step_through_odd_replies(redis_url: str, namespace: str, depth: int,
                                                          make_tier: MakeTier,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On one connection (one request in flight, or 8 pipelined so replies sit buffered): a missing key,
    longer and shorter values, an error reply (WRONGTYPE), another layout's value of the same length,
    a foreign header and a flipped payload byte are misses at their own index; every block between
    them comes back bit-exact, and the same keys read again after a good put are hits."""
    import kvtier.tiers.redis.tier as tier_module

    monkeypatch.setattr(tier_module, "_PIPELINE_DEPTH", depth)
    tier = make_tier("r", {0: SMALL_256}, namespace=namespace, url=redis_url, max_connections=1)
    other = make_tier("o", {0: OTHER_256}, namespace=namespace, url=redis_url)
    n = 16
    keys, blocks = keys_for(n), kv_like(SMALL_256, n, seed=7)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * n
    assert asyncio.run(other.put([keys[9]], kv_like(OTHER_256, 1, seed=8))) == [True]
    client = sync_client(redis_url)
    rkey = [tier.redis_key(k) for k in keys]
    good = client.get(rkey[0])
    client.delete(rkey[1])                                            # missing: $-1
    client.set(rkey[3], client.get(rkey[3]) + b"tail")                # longer by 4 bytes
    client.set(rkey[5], client.get(rkey[5])[:-7])                     # shorter by 7 bytes
    client.delete(rkey[7])
    client.rpush(rkey[7], b"x")                                       # -WRONGTYPE error reply
    client.set(rkey[11], good)                                        # key 0's value: its header says key 0
    flipped = bytearray(client.get(rkey[13]))
    flipped[-1] ^= 0x01                                               # last payload byte
    client.set(rkey[13], bytes(flipped))
    client.close()
    bad = [1, 3, 5, 7, 9, 11, 13]
    out = empty_like_blocks(SMALL_256, n)
    hits = asyncio.run(tier.get(keys, out))
    assert [i for i in range(n) if not hits[i]] == bad
    assert all(torch.equal(out[i], blocks[i]) for i in range(n) if hits[i])
    assert tier.counters.errors == {"corrupt": 5, "server": 1}

    # the corrupt values were deleted; stored again (the list first removed), every key is a hit
    sync_client(redis_url).delete(rkey[7])
    assert asyncio.run(tier.put(keys, blocks)) == [True] * n
    again = empty_like_blocks(SMALL_256, n)
    assert asyncio.run(tier.get(keys, again)) == [True] * n
    assert all(torch.equal(a, b) for a, b in zip(blocks, again, strict=True))


def test_stored_values_are_the_codecs_bytes(redis_url: str, namespace: str, client: str,
                                            make_tier: MakeTier) -> None:
    """Whichever client stores it (native or Python), a value is exactly the codec's encoding, TTL and
    all: any kvtier version or process reads it, and the native client is not a format of its own."""
    tier = make_tier("r", {0: SMALL, 1: SMALL_256}, namespace=namespace, url=redis_url, ttl_seconds=30)
    keys = keys_for(3) + keys_for(2, group=1)
    blocks = kv_like(SMALL, 3) + kv_like(SMALL_256, 2, seed=3)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 5
    assert tier._native is (client == "native client")
    redis_client = sync_client(redis_url)
    for key, block in zip(keys, blocks, strict=True):
        header, payload = encode_block(key, tier.layouts[key.group_id].fingerprint(), block.numpy(),
                                       namespace_fp=tier.namespace_fp)
        assert redis_client.get(tier.redis_key(key)) == bytes(header) + bytes(payload)
        assert 0 < redis_client.pttl(tier.redis_key(key)) <= 30_000
    assert tier.counters.blocks_written == 5
    assert tier.counters.bytes_written == (3 * (HEADER_SIZE + SMALL.nbytes)
                                           + 2 * (HEADER_SIZE + SMALL_256.nbytes))


def test_compressed_values_are_read_by_an_uncompressed_tier(redis_url: str, namespace: str,
                                                            make_tier: MakeTier) -> None:
    """A tier with ``compression: none`` reads what an lz4 tier of the namespace stored: the native
    client hands such values back and the Python client decodes them (hits, bit-exact, no error)."""
    writer = make_tier("w", {0: SMALL}, namespace=namespace, url=redis_url, compression="lz4")
    reader = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url, max_connections=1)
    keys, blocks = keys_for(6), compressible(SMALL, 6)
    plain = kv_like(SMALL, 6, seed=4)
    assert asyncio.run(writer.put(keys[:3], blocks[:3])) == [True] * 3
    assert asyncio.run(reader.put(keys[3:], plain[3:])) == [True] * 3
    out = empty_like_blocks(SMALL, 6)
    assert asyncio.run(reader.get(keys, out)) == [True] * 6
    assert all(torch.equal(out[i], blocks[i]) for i in range(3))
    assert all(torch.equal(out[i], plain[i]) for i in range(3, 6))
    assert reader.counters.errors == {}


def test_a_reply_that_is_not_resp_fails_the_connection_not_the_caller(make_tier: MakeTier) -> None:
    """A server that answers a GET or SET with an array (no Redis does): every block of the run is a
    miss or ``False``, counted as a protocol error; the next batch connects afresh and fails the same."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(5)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    while conn.recv(1 << 20):
                        conn.sendall(b"*1\r\n:1\r\n")
                except OSError:
                    pass

    import threading

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    tier = make_tier("r", {0: SMALL}, namespace="garbage", url=f"redis://127.0.0.1:{port}/0",
                     circuit_breaker=CircuitBreakerConfig(failures=100, cooldown_seconds=0),
                     max_connections=1)
    keys = keys_for(4)
    try:
        assert asyncio.run(tier.get(keys, empty_like_blocks(SMALL, 4))) == [False] * 4
        assert asyncio.run(tier.put(keys, kv_like(SMALL, 4))) == [False] * 4
        assert tier.counters.errors == {"protocol": 2}
    finally:
        listener.close()
        thread.join(5)


def test_native_helper_checks_its_arguments(client: str) -> None:
    """The helper's Python side names what does not agree instead of handing C a wrong length."""
    if client != "native client":
        pytest.skip("a check of the native helper itself")
    import numpy as np

    with pytest.raises(ValueError, match=r"2 keys, addresses uint64\(1,\)"):
        host.redis_get(0, [b"a", b"b"], np.zeros(1, np.uint64), np.zeros(2, np.int64), 4096,
                       bytes(2 * HEADER_SIZE), HEADER_SIZE, 40, 1, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="128 header bytes of 128 each"):
        host.redis_set(0, [b"a", b"b"], np.zeros(2, np.uint64), np.zeros(2, np.int64), bytes(HEADER_SIZE),
                       HEADER_SIZE, 40, b"", 3, 1, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"stop must be one int32, got int64\(1,\)"):
        host.redis_get(0, [b"a"], np.zeros(1, np.uint64), np.zeros(1, np.int64), 4096, bytes(HEADER_SIZE),
                       HEADER_SIZE, 40, 1, np.zeros(1, np.int64))


def test_a_key_overwritten_with_another_length_is_a_miss_then_a_hit(redis_url: str, namespace: str,
                                                                   make_tier: MakeTier) -> None:
    """Another tier of the namespace stores a 2 MiB block under a key this tier reads as 256 KiB: a miss
    (not a hang waiting for the length it expected, not a short read); stored again, a hit."""
    tier = make_tier("r", {0: SMALL_256}, namespace=namespace, url=redis_url, max_connections=1)
    big = make_tier("b", {0: LARGE}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(3), kv_like(SMALL_256, 3, seed=9)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 3
    assert asyncio.run(big.put(keys[1:2], kv_like(LARGE, 1))) == [True]
    out = empty_like_blocks(SMALL_256, 3)
    assert asyncio.run(tier.get(keys, out)) == [True, False, True]
    assert torch.equal(out[0], blocks[0]) and torch.equal(out[2], blocks[2])
    assert tier.counters.errors == {"corrupt": 1}
    assert asyncio.run(tier.put(keys[1:2], blocks[1:2])) == [True]
    assert asyncio.run(tier.get(keys, out)) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))


def test_no_server_is_a_miss_not_an_exception(make_tier: MakeTier) -> None:
    """Nothing listens at the url: puts are False, gets and lookups miss, errors are counted."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the tier connects: refused
    tier = make_tier("r", {0: SMALL_256}, namespace="down", url=f"redis://127.0.0.1:{port}/0",
                     connect_timeout=0.5, timeout=0.5)
    keys, blocks = keys_for(4), kv_like(SMALL_256, 4)
    assert asyncio.run(tier.put(keys, blocks)) == [False] * 4
    assert asyncio.run(tier.get(keys, empty_like_blocks(SMALL_256, 4))) == [False] * 4
    assert asyncio.run(tier.contains(keys)) == [False] * 4
    assert tier.counters.errors


def test_wrong_layout_fingerprint_is_a_miss(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    writer = make_tier("w", {0: SMALL}, namespace=namespace, url=redis_url)
    reader = make_tier("r", {0: SMALL_OTHER}, namespace=namespace, url=redis_url)
    keys = keys_for(3)
    assert asyncio.run(writer.put(keys, kv_like(SMALL, 3))) == [True] * 3
    assert asyncio.run(reader.get(keys, empty_like_blocks(SMALL_OTHER, 3))) == [False] * 3
    assert reader.counters.errors == {"corrupt": 3}
    assert asyncio.run(writer.contains(keys)) == [False] * 3  # deleted


def test_ttl_is_set(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    with_ttl = make_tier("t", {0: SMALL}, namespace=namespace, url=redis_url, ttl_seconds=30)
    fractional = make_tier("f", {0: SMALL}, namespace=namespace, url=redis_url, ttl_seconds=1.5)
    without = make_tier("n", {0: SMALL}, namespace=namespace, url=redis_url)
    ttl_keys, short_keys, plain_keys = keys_for(2), keys_for(2), keys_for(2)
    asyncio.run(with_ttl.put(ttl_keys, kv_like(SMALL, 2)))
    asyncio.run(fractional.put(short_keys, kv_like(SMALL, 2)))
    asyncio.run(without.put(plain_keys, kv_like(SMALL, 2)))
    client = sync_client(redis_url)
    assert all(0 < client.pttl(with_ttl.redis_key(k)) <= 30_000 for k in ttl_keys)
    # PX, not whole seconds
    assert all(1_000 < client.pttl(fractional.redis_key(k)) <= 1_500 for k in short_keys)
    assert all(client.pttl(without.redis_key(k)) == -1 for k in plain_keys)
    client.close()


def test_contains_delete_and_keys(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    tier = make_tier("r", {0: SMALL, 2: SMALL}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(5) + keys_for(3, group=2), kv_like(SMALL, 9)
    assert asyncio.run(tier.put(keys + keys[:1], blocks)) == [True] * 9  # a key given twice: the last wins
    out = empty_like_blocks(SMALL, 1)
    assert asyncio.run(tier.get(keys[:1], out)) == [True] and torch.equal(out[0], blocks[8])
    assert sorted(tier.keys()) == sorted(keys)
    asyncio.run(tier.delete(keys[:4] + keys_for(1)))
    assert asyncio.run(tier.contains(keys)) == [False] * 4 + [True] * 4
    assert sorted(tier.keys()) == sorted(keys[4:])
    assert tier.usage_bytes() == 0


def test_concurrent_batches_share_a_small_pool(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url, max_connections=2)
    batches = [(keys_for(16), kv_like(SMALL, 16, seed=i)) for i in range(12)]

    async def scenario() -> list[list[bool]]:
        await asyncio.gather(*(tier.put(k, b) for k, b in batches))
        outs = [empty_like_blocks(SMALL, 16) for _ in batches]
        hits = await asyncio.gather(*(tier.get(k, o) for (k, _), o in zip(batches, outs, strict=True)))
        for (_, blocks), out in zip(batches, outs, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        await tier.close()
        return hits

    assert asyncio.run(scenario()) == [[True] * 16] * 12
    assert tier.counters.errors == {}


def test_batches_in_flight_share_a_nodes_streams(redis_url: str, namespace: str, make_tier: MakeTier,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve batches at once on eight connections: the first two take four streams each, the others
    the one each that is left, and every stream is given back, by a cancelled get too; a lone batch
    then takes four again. Every block exact."""
    from kvtier.tiers.redis import tier as tier_module

    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url, max_connections=8)
    streams: dict[int, int] = {}
    real = tier_module.run_stream

    def counting(pool: Any, run: Any, *args: Any) -> None:
        streams[id(run)] = streams.get(id(run), 0) + 1
        real(pool, run, *args)

    monkeypatch.setattr(tier_module, "run_stream", counting)
    batches = [(keys_for(16), kv_like(SMALL, 16, seed=i)) for i in range(12)]

    async def scenario() -> list[int]:
        assert await asyncio.gather(*(tier.put(k, b) for k, b in batches)) == [[True] * 16] * 12
        at_once = sorted(streams.values(), reverse=True)
        outs = [empty_like_blocks(SMALL, 16) for _ in batches]
        hits = await asyncio.gather(*(tier.get(k, o) for (k, _), o in zip(batches, outs, strict=True)))
        assert hits == [[True] * 16] * 12
        for (_, blocks), out in zip(batches, outs, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        cut = asyncio.create_task(tier.get(batches[0][0], empty_like_blocks(SMALL, 16)))
        await asyncio.sleep(0)
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        assert set(tier._busy_streams.values()) == {0}
        streams.clear()
        out = empty_like_blocks(SMALL, 16)
        assert await tier.get(batches[1][0], out) == [True] * 16
        assert list(streams.values()) == [4]
        await tier.close()
        return at_once

    assert asyncio.run(scenario()) == [4, 4] + [1] * 10
    assert tier.counters.errors == {}


# --- faults -------------------------------------------------------------------------------------------------
def test_circuit_breaker_answers_fast_and_recovers(redis_server_factory, make_tier: MakeTier) -> None:
    server = redis_server_factory(start=False)  # a port nobody listens on (yet)
    tier = make_tier("r", {0: SMALL}, namespace="breaker", url=server.url, circuit_breaker=FAST_BREAKER,
                     connect_timeout=0.5, timeout=0.5)
    keys, blocks = keys_for(32), kv_like(SMALL, 32)

    async def failing() -> None:
        for _ in range(2):  # two failed batches open the breaker
            assert await tier.get(keys, empty_like_blocks(SMALL, 32)) == [False] * 32
        refused = tier.counters.errors["connection"]
        start = time.perf_counter()
        assert await tier.put(keys, blocks) == [False] * 32
        assert await tier.get(keys, empty_like_blocks(SMALL, 32)) == [False] * 32
        assert await tier.contains(keys) == [False] * 32
        assert time.perf_counter() - start < 1.0
        assert tier.counters.errors["connection"] == refused  # nothing was tried while open
        assert tier.counters.errors["circuit_open"] == 3 * 32

    asyncio.run(failing())
    server.start()
    time.sleep(FAST_BREAKER.cooldown_seconds)

    async def recovered() -> None:
        assert await tier.put(keys, blocks) == [True] * 32  # the probe, then closed
        out = empty_like_blocks(SMALL, 32)
        assert await tier.get(keys, out) == [True] * 32
        assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        await tier.close()

    asyncio.run(recovered())


def test_server_crash_and_restart(redis_server_factory, make_tier: MakeTier) -> None:
    server = redis_server_factory()
    tier = make_tier("r", {0: SMALL}, namespace="restart", url=server.url, circuit_breaker=FAST_BREAKER,
                     connect_timeout=0.5, timeout=0.5)
    keys, blocks = keys_for(16), kv_like(SMALL, 16)

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * 16
        assert await tier.get(keys, empty_like_blocks(SMALL, 16)) == [True] * 16  # connections now pooled
        server.kill()
        assert await tier.get(keys, empty_like_blocks(SMALL, 16)) == [False] * 16
        assert await tier.put(keys, blocks) == [False] * 16
        assert tier.counters.errors.get("connection", 0) >= 2
        server.start()
        await asyncio.sleep(FAST_BREAKER.cooldown_seconds)
        # The server came back empty (no persistence): blocks miss, the tier works again by itself.
        assert await tier.get(keys, empty_like_blocks(SMALL, 16)) == [False] * 16
        assert await tier.put(keys, blocks) == [True] * 16
        out = empty_like_blocks(SMALL, 16)
        assert await tier.get(keys, out) == [True] * 16
        assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        await tier.close()

    asyncio.run(scenario())


def test_hung_server_times_out_and_recovers(redis_server_factory, make_tier: MakeTier) -> None:
    server = redis_server_factory()
    tier = make_tier("r", {0: SMALL}, namespace="hung", url=server.url, circuit_breaker=FAST_BREAKER,
                     connect_timeout=0.3, timeout=0.3)
    keys, blocks = keys_for(16), kv_like(SMALL, 16)

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * 16
        server.process.send_signal(signal.SIGSTOP)  # accepts bytes, never answers
        try:
            start = time.perf_counter()
            assert await tier.get(keys, empty_like_blocks(SMALL, 16)) == [False] * 16
            assert await tier.put(keys, blocks) == [False] * 16
            assert await tier.get(keys, empty_like_blocks(SMALL, 16)) == [False] * 16  # breaker open: at once
            assert time.perf_counter() - start < 2.0
            assert tier.counters.errors.get("timeout", 0) >= 2
            assert tier.counters.errors["circuit_open"] == 16
        finally:
            server.process.send_signal(signal.SIGCONT)
        await asyncio.sleep(FAST_BREAKER.cooldown_seconds)
        out = empty_like_blocks(SMALL, 16)
        assert await tier.get(keys, out) == [True] * 16
        assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        await tier.close()

    asyncio.run(scenario())


def _in_forked_child(body: Callable[[], bool]) -> int:
    """Run ``body`` in a forked child that reports through its exit status only (0: it returned True)
    and never hangs (a 20 s alarm); the child's exit code."""
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(20)
        try:
            os._exit(0 if body() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _reads_back(tier: RedisTier, keys: list[BlockKey], out: list[torch.Tensor],
                blocks: list[torch.Tensor]) -> bool:
    """In a forked child: whether ``get`` fills ``out`` with ``blocks`` (compared as bytes: torch can
    hang in a forked child)."""
    for o in out:
        o.numpy().fill(0)
    return asyncio.run(tier.get(keys, out)) == [True] * len(keys) and all(
        o.numpy().tobytes() == b.numpy().tobytes() for o, b in zip(out, blocks, strict=True))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_uses_the_tier_it_inherited(redis_url: str, namespace: str,
                                                   make_tier: MakeTier) -> None:
    """A tier used in the parent (I/O threads running, idle connections pooled) works in a forked child
    on connections of its own: before, the child waited forever for the parent's threads, and the two
    processes would have shared pooled sockets (each could take the other's replies). Both keep
    working, each reading what the other stored."""
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(9), kv_like(SMALL, 9)
    out = empty_like_blocks(SMALL, 9)  # (made here: torch can hang in a forked child)
    assert asyncio.run(tier.put(keys[:8], blocks[:8])) == [True] * 8
    assert asyncio.run(tier.get(keys[:8], out[:8])) == [True] * 8
    parent_sockets = {conn._sock.fileno() for pool in tier._pools.values() for conn in pool._idle}
    assert parent_sockets  # the case that matters: pooled connections at the fork
    def child() -> bool:
        ok = _reads_back(tier, keys[:8], out[:8], blocks[:8])
        ok = ok and asyncio.run(tier.put(keys[8:], blocks[8:])) == [True]
        asyncio.run(tier.close())
        return ok

    assert _in_forked_child(child) == 0
    assert asyncio.run(tier.get(keys, out)) == [True] * 9  # on the parent's own pooled connections
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert tier.counters.errors == {}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_fork_while_connections_are_busy(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    """A fork while the parent's I/O threads hold both of a node's connections: the child closes its
    copies of them (no descriptor left open there) and gets both slots back, so its own reads run
    at once instead of waiting for threads it does not have; the parent's connections keep working."""
    tier = make_tier("r", {0: SMALL}, namespace=namespace, url=redis_url, max_connections=2)
    keys, blocks = keys_for(4), kv_like(SMALL, 4)
    out = empty_like_blocks(SMALL, 4)  # (made here: torch can hang in a forked child)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 4
    assert tier.address is not None
    pool = tier._pool(tier.address)
    busy = [pool.acquire(5.0), pool.acquire(5.0)]  # as an I/O thread holds a connection mid-request
    assert all(conn is not None for conn in busy)
    busy_fds = [conn._sock.fileno() for conn in busy if conn is not None]
    def child() -> bool:
        closed = 0
        for fd in busy_fds:
            try:
                os.fstat(fd)
            except OSError:
                closed += 1
        ok = closed == 2 and _reads_back(tier, keys, out, blocks)
        asyncio.run(tier.close())
        return ok

    assert _in_forked_child(child) == 0
    for conn in busy:  # the parent's copies still work, then go back to its pool
        assert conn is not None
        conn.send([b"*1\r\n$4\r\nPING\r\n"])
        assert conn.read_simple() == b"PONG"
        pool.release(conn, reusable=True)
    assert asyncio.run(tier.get(keys, out)) == [True] * 4
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    asyncio.run(tier.close())


def _child_reads(url: str, namespace: str, hashes: list[bytes], results: multiprocessing.Queue) -> None:
    tier = RedisTier("child", {0: SMALL}, namespace=namespace, url=url)
    keys = [BlockKey(h, 0) for h in hashes]
    out = empty_like_blocks(SMALL, len(keys))
    hits = asyncio.run(tier.get(keys, out))
    asyncio.run(tier.close())
    results.put((hits, [bytes(o.numpy()) for o in out]))


def test_two_processes_share_blocks(redis_url: str, namespace: str, make_tier: MakeTier) -> None:
    tier = make_tier("parent", {0: SMALL}, namespace=namespace, url=redis_url)
    keys, blocks = keys_for(8), kv_like(SMALL, 8)
    assert asyncio.run(tier.put(keys, blocks)) == [True] * 8
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child_reads,
                        args=(redis_url, namespace, [k.block_hash for k in keys], results))
    child.start()
    hits, data = results.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert hits == [True] * 8
    assert data == [bytes(b.numpy()) for b in blocks]


def test_tls_round_trip(redis_server_factory, tmp_path: Path, make_tier: MakeTier) -> None:
    ca, cert, key = make_test_certificates(tmp_path)
    server = redis_server_factory(start=False)
    server.extra_args = ["--port", "0", "--tls-port", str(server.port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                         "--tls-auth-clients", "no"]
    server.start(wait=False)  # the plain-text readiness check cannot talk TLS: the first put waits instead
    deadline = time.monotonic() + 10
    tier = make_tier("tls", {0: SMALL, 1: LARGE}, namespace="tls", url=f"rediss://127.0.0.1:{server.port}/0",
                     tls_ca_file=str(ca),
                     circuit_breaker=CircuitBreakerConfig(failures=100, cooldown_seconds=0))
    keys, blocks = keys_for(4) + keys_for(2, group=1), kv_like(SMALL, 4) + kv_like(LARGE, 2)
    out = empty_like_blocks(SMALL, 4) + empty_like_blocks(LARGE, 2)
    while not asyncio.run(tier.put(keys, blocks))[0]:
        if server.process is not None and server.process.poll() is not None:
            pytest.skip("this redis-server was built without TLS")
        assert time.monotonic() < deadline, tier.counters.errors
        time.sleep(0.05)
    assert asyncio.run(tier.get(keys, out)) == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))


# --- cluster ------------------------------------------------------------------------------------------------
def _node_of(handle, tier: RedisTier, keys: list[BlockKey]) -> list[int]:
    """Index (into handle.nodes) of the master that owns each key, from CLUSTER SLOTS."""
    client = redis.Redis(host="127.0.0.1", port=handle.nodes[0].port, socket_timeout=5)
    ranges = client.execute_command("CLUSTER SLOTS")
    client.close()
    ports = [n.port for n in handle.nodes]
    owner = {}
    for row in ranges:
        for slot in range(int(row[0]), int(row[1]) + 1):
            owner[slot] = ports.index(int(row[2][1]))
    return [owner[key_slot(tier.redis_key(k))] for k in keys]


def test_cluster_round_trip_spreads_blocks(redis_cluster, make_tier: MakeTier) -> None:
    tier = make_tier("c", {0: SMALL, 1: LARGE}, namespace=f"c-{uuid.uuid4().hex[:8]}", cluster=True,
                     startup_nodes=redis_cluster.startup_nodes[:1], compression="lz4")
    keys = keys_for(60) + keys_for(4, group=1)
    blocks = kv_like(SMALL, 30) + compressible(SMALL, 30) + kv_like(LARGE, 4)
    out = empty_like_blocks(SMALL, 60) + empty_like_blocks(LARGE, 4)

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * 64
        assert await tier.get(keys, out) == [True] * 64
        assert await tier.contains(keys) == [True] * 64
        await tier.delete(keys[:10])
        assert await tier.contains(keys[:12]) == [False] * 10 + [True] * 2
        await tier.close()

    asyncio.run(scenario())
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
    assert set(_node_of(redis_cluster, tier, keys)) == {0, 1, 2}  # the batch really was split
    assert sorted(tier.keys()) == sorted(keys[10:])
    assert tier.counters.errors == {}


def _migrate_slot(handle, slot: int, source: int, target: int) -> None:
    """Move one slot and its keys between masters, as ``redis-cli --cluster reshard`` does."""
    nodes = [redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=5) for n in handle.nodes]
    ids = [n.execute_command("CLUSTER MYID") for n in nodes]
    ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
    nodes[target].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
    nodes[source].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
    while keys := nodes[source].execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        nodes[source].execute_command("MIGRATE", "127.0.0.1", handle.nodes[target].port, "", 0, 5000,
                                      "KEYS", *keys)
    for node in nodes:
        node.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
        node.close()


def test_cluster_follows_moved_slots(redis_cluster, make_tier: MakeTier) -> None:
    tier = make_tier("c", {0: SMALL}, namespace=f"m-{uuid.uuid4().hex[:8]}",
                     startup_nodes=redis_cluster.startup_nodes)
    keys, blocks = keys_for(32), kv_like(SMALL, 32)
    owner = _node_of(redis_cluster, tier, keys)
    source = owner[0]
    n_moved = sum(o == source for o in owner)

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * 32  # the tier now holds the slot map
        for slot in {key_slot(tier.redis_key(k)) for k, o in zip(keys, owner, strict=True) if o == source}:
            _migrate_slot(redis_cluster, slot, source, (source + 1) % 3)
        out = empty_like_blocks(SMALL, 32)
        assert await tier.get(keys, out) == [True] * 32  # MOVED, retried at the new owner
        assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        assert tier.counters.errors == {"moved": n_moved}
        await asyncio.sleep(1.0)  # the slot map is re-read at most once a second
        await tier.contains(keys[:1])
        assert await tier.get(keys, empty_like_blocks(SMALL, 32)) == [True] * 32
        assert tier.counters.errors == {"moved": n_moved}  # routed right the second time
        await tier.delete(keys)
        await tier.close()

    asyncio.run(scenario())


def test_cluster_follows_ask_during_a_slot_migration(private_redis_cluster, make_tier: MakeTier) -> None:
    """Mid-migration, keys already moved answer ASK at the source; each is read, written, checked and
    deleted at the target behind ASKING, and the slot map stays as it is until the migration ends."""
    handle = private_redis_cluster
    tier = make_tier("c", {0: SMALL}, namespace="ask", startup_nodes=handle.startup_nodes[:1])
    candidates = keys_for(60)
    owner = _node_of(handle, tier, candidates)
    source, target = 0, 1
    keys = [k for k, o in zip(candidates, owner, strict=True) if o == source][:8]
    assert len(keys) >= 4
    moved, staying = keys[: len(keys) // 2], keys[len(keys) // 2:]
    blocks = kv_like(SMALL, len(keys))
    nodes = [redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=5) for n in handle.nodes]
    ids = [i.decode() if isinstance(i, bytes) else i
           for i in (n.execute_command("CLUSTER MYID") for n in nodes)]
    slots = sorted({key_slot(tier.redis_key(k)) for k in keys})

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * len(keys)  # the tier now holds the slot map
        for slot in slots:  # start migrating: the source answers ASK for keys it no longer holds
            nodes[target].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
            nodes[source].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
        for key in moved:
            nodes[source].execute_command("MIGRATE", "127.0.0.1", handle.nodes[target].port,
                                          tier.redis_key(key), 0, 5000)

        out = empty_like_blocks(SMALL, len(keys))
        assert await tier.get(keys, out) == [True] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
        assert tier.counters.errors == {"ask": len(moved)}
        assert await tier.contains(keys) == [True] * len(keys)
        assert tier.counters.errors == {"ask": 2 * len(moved)}

        fresh = kv_like(SMALL, 2, seed=7)  # overwrite a moved key (at the target) and a staying one
        assert await tier.put([moved[0], staying[0]], fresh) == [True, True]
        again = empty_like_blocks(SMALL, 2)
        assert await tier.get([moved[0], staying[0]], again) == [True, True]
        assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
        await tier.delete([moved[1]])
        assert await tier.get([moved[1]], empty_like_blocks(SMALL, 1)) == [False]
        assert set(tier.counters.errors) == {"ask"}  # no MOVED, no topology error: the map was right

        for slot in slots:  # finish the migration: now the slots have a new owner, MOVED from here on
            while rest := nodes[source].execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                nodes[source].execute_command("MIGRATE", "127.0.0.1", handle.nodes[target].port, "", 0, 5000,
                                              "KEYS", *rest)
            for node in nodes:
                node.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
        asks = tier.counters.errors["ask"]
        out = empty_like_blocks(SMALL, len(staying))
        assert await tier.get(staying, out) == [True] * len(staying)
        assert torch.equal(out[0], fresh[1]) and all(torch.equal(a, b) for a, b in
                                                     zip(blocks[len(moved) + 1:], out[1:], strict=True))
        assert tier.counters.errors == {"ask": asks, "moved": len(staying)}
        await tier.close()

    try:
        asyncio.run(scenario())
    finally:
        for node in nodes:
            node.close()


def test_cluster_node_dies(private_redis_cluster, make_tier: MakeTier) -> None:
    handle = private_redis_cluster
    tier = make_tier("c", {0: SMALL}, namespace="dies", startup_nodes=handle.startup_nodes,
                     circuit_breaker=FAST_BREAKER, connect_timeout=0.5, timeout=0.5)
    keys, blocks = keys_for(48), kv_like(SMALL, 48)
    owner = _node_of(handle, tier, keys)
    assert set(owner) == {0, 1, 2}
    alive = [o != 0 for o in owner]

    async def scenario() -> None:
        assert await tier.put(keys, blocks) == [True] * 48
        assert await tier.get(keys, empty_like_blocks(SMALL, 48)) == [True] * 48
        handle.nodes[0].kill()
        for _ in range(3):  # pooled connections die, reconnects are refused, then the breaker opens
            out = empty_like_blocks(SMALL, 48)
            assert await tier.get(keys, out) == alive
            assert all(torch.equal(out[i], blocks[i]) for i in range(48) if alive[i])
        assert await tier.contains(keys) == alive
        assert await tier.put(keys, blocks) == alive
        await tier.close()

    asyncio.run(scenario())
    assert tier.counters.errors.get("connection", 0) >= 1
    assert tier.counters.errors.get("circuit_open", 0) >= 1
