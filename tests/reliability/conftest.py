"""The harness of the fault and stress suite: one oracle, workloads, fault injectors, the fault table.

Every reliability test and ``benchmarks/soak.py`` end with the same check, the *oracle*: every block
ever acknowledged as stored is either returned bit-exact by ``load`` or reported missing — nothing
else. A block's bytes are a pure function of its key (random bytes seeded by the key's hash), so any
thread, process or restarted process verifies any block it loads without sharing state with the
writer, and a block served under the wrong key, torn, stale or half-written cannot pass.

Besides the oracle the harness checks what the design promises about state (``consistency_problems``):
no pins left, no half-written (pending) entries, per-tier usage counters equal to what the tiers
really hold, the file tier's index equal to the files on disk, no temporary files left.

Pieces: :class:`Oracle`, :func:`run_workload` (threads of store/load/lookup on overlapping keys,
bounded by time and count, every call under a timeout so a deadlock fails instead of hanging),
:class:`SyscallFaults` (ENOSPC/EIO injected into ``os.pwritev``/``os.preadv``/``os.rename``),
:func:`corrupt_bytes` / :func:`corrupt_file` (bit flips, truncation, forged headers),
:class:`FaultProxy` (a loopback TCP proxy that passes, blackholes or slows Redis traffic; with no
upstream it is a server that accepts and never answers), private ``redis-server`` processes, and
:class:`FaultRow` with :func:`record` — the fault table printed at the end of the session when
``KVTIER_FAULT_TABLE`` is set (``-`` prints it, a path also writes it there) or with ``-v``.

It is a conftest (pytest loads it for ``tests/reliability``); the soak script imports it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import shutil
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvtier import BlockKey, TieredCache
from kvtier.codec import HEADER_SIZE, encode_block
from kvtier.layout import BlockLayout
from kvtier.residency import READY
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.file import BLOCK_SUFFIX, PAGE, TMP_SUFFIX, FileTier
from tests.helpers import SMALL_MODEL, small_layout
from tests.tiers.conftest import REDIS_HOST, RedisProcess, free_port, start_cluster, unavailable

#: 2 layers × 2 × 16 tokens × 2 heads × 64 fp16 = 16 KiB per block: small, so many operations per second.
LAYOUT = small_layout()
BLOCK = LAYOUT.nbytes


# --- the oracle ------------------------------------------------------------------------------------------
def key_seed(key: BlockKey) -> int:
    return xxhash.xxh64_intdigest(bytes(key.block_hash) + b"|" + str(key.group_id).encode()) >> 1


def expected_bytes(key: BlockKey, nbytes: int = BLOCK) -> torch.Tensor:
    """The only bytes ``key`` may ever hold: 1-D uint8, random, seeded by the key."""
    gen = torch.Generator().manual_seed(key_seed(key))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def blocks_for(keys: Sequence[BlockKey], layout: BlockLayout = LAYOUT) -> torch.Tensor:
    """``[n, *layout.shape]`` blocks of the layout's dtype holding each key's expected bytes."""
    rows = torch.stack([expected_bytes(k, layout.nbytes) for k in keys]) if keys else \
        torch.empty((0, layout.nbytes), dtype=torch.uint8)
    return rows.view(layout.dtype).view(len(keys), *layout.shape)


def universe(n: int, tag: str = "", group_id: int = 0, hash_bytes: int = 16) -> list[BlockKey]:
    """``n`` distinct keys; the tag keeps universes of different runs apart."""
    salt = tag.encode()
    return [BlockKey(xxhash.xxh128_digest(salt + i.to_bytes(8, "little"))[:hash_bytes]
                     .ljust(hash_bytes, b"\0"), group_id) for i in range(n)]


class Oracle:
    """Calls the engine-facing API for the test and judges every answer; thread-safe.

    ``offered``: keys passed to ``store``; ``acked``: keys of ``store`` calls that counted every
    block. ``wrong``: blocks ``load`` returned whose bytes are not the key's. ``errors``: exceptions
    the engine-facing calls raised (the design says faults become misses, so these must be 0).
    ``hangs``: calls that did not return within ``call_timeout`` (a deadlock, or a broken deadline).
    """

    def __init__(self, layout: BlockLayout = LAYOUT, call_timeout: float = 30.0) -> None:
        self.layout = layout
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self.offered: set[BlockKey] = set()
        self.acked: set[BlockKey] = set()
        self.operations = 0
        self.verified = 0
        self.wrong = 0
        self.wrong_keys: list[BlockKey] = []
        self.loaded_hits = 0
        self.errors: list[str] = []
        self.hangs = 0
        self.max_latency = 0.0

    # --- engine-facing calls, judged -------------------------------------------------------------------
    def _call(self, future: concurrent.futures.Future[int], started: float) -> int | None:
        try:
            result = future.result(timeout=self.call_timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.hangs += 1
                self.operations += 1
            return None
        except Exception as exc:
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.operations += 1
            return None
        elapsed = time.perf_counter() - started
        with self._lock:
            self.operations += 1
            self.max_latency = max(self.max_latency, elapsed)
        return result

    def store(self, cache: TieredCache, keys: Sequence[BlockKey]) -> int | None:
        blocks = blocks_for(keys, self.layout)
        with self._lock:
            self.offered.update(keys)
        started = time.perf_counter()
        stored = self._call(cache.submit_store(list(keys), blocks), started)
        if stored is not None and stored == len(keys):
            with self._lock:
                self.acked.update(keys)
        return stored

    def load(self, cache: TieredCache, keys: Sequence[BlockKey]) -> int | None:
        out = torch.empty((len(keys), *self.layout.shape), dtype=self.layout.dtype)
        started = time.perf_counter()
        n = self._call(cache.submit_load(list(keys), out), started)
        if n is not None:
            self.check(keys, out, n)
        return n

    def lookup(self, cache: TieredCache, keys: Sequence[BlockKey]) -> int | None:
        started = time.perf_counter()
        future: concurrent.futures.Future[int] = cache._submit(cache.core.lookup(list(keys)))
        n = self._call(future, started)
        if n is not None and not 0 <= n <= len(keys):
            with self._lock:
                self.errors.append(f"lookup of {len(keys)} keys answered {n}")
        return n

    # --- judging ----------------------------------------------------------------------------------------
    def check(self, keys: Sequence[BlockKey], out: torch.Tensor, n: int) -> None:
        """Blocks ``[0, n)`` of ``out`` must be exactly the keys' bytes."""
        if not 0 <= n <= len(keys):
            with self._lock:
                self.errors.append(f"load of {len(keys)} keys answered {n}")
            return
        rows = out.view(torch.uint8).reshape(len(keys), -1) if len(keys) else out
        bad = [keys[i] for i in range(n)
               if not torch.equal(rows[i], expected_bytes(keys[i], self.layout.nbytes))]
        with self._lock:
            self.verified += n
            self.loaded_hits += n
            self.wrong += len(bad)
            self.wrong_keys.extend(bad[:16])

    def sweep(self, cache: TieredCache, keys: Sequence[BlockKey] | None = None) -> tuple[int, int]:
        """Load every offered key alone: each is exact or missing. Returns (hits, misses)."""
        hits = misses = 0
        for key in sorted(self.offered if keys is None else keys):
            n = self.load(cache, [key])
            if n:
                hits += 1
            else:
                misses += 1
        return hits, misses

    def merge(self, counts: Mapping[str, Any]) -> None:
        """Add another process's figures (see :meth:`counts`)."""
        with self._lock:
            self.operations += counts["operations"]
            self.verified += counts["verified"]
            self.wrong += counts["wrong"]
            self.loaded_hits += counts["loaded_hits"]
            self.errors.extend(counts["errors"])
            self.hangs += counts["hangs"]
            self.max_latency = max(self.max_latency, counts["max_latency"])
            self.offered.update(BlockKey(h, g) for h, g in counts["offered"])
            self.acked.update(BlockKey(h, g) for h, g in counts["acked"])

    def counts(self) -> dict[str, Any]:
        """Picklable figures, for a child process to send back."""
        with self._lock:
            return dict(operations=self.operations, verified=self.verified, wrong=self.wrong,
                        loaded_hits=self.loaded_hits, errors=list(self.errors), hangs=self.hangs,
                        max_latency=self.max_latency, offered=[tuple(k) for k in self.offered],
                        acked=[tuple(k) for k in self.acked])

    def assert_clean(self) -> None:
        assert self.wrong == 0, f"{self.wrong} wrong blocks, e.g. {self.wrong_keys[:4]}"
        assert not self.errors, f"{len(self.errors)} errors surfaced to the caller, e.g. {self.errors[:3]}"
        assert self.hangs == 0, f"{self.hangs} calls did not return within {self.call_timeout} s"


# --- workloads --------------------------------------------------------------------------------------------
@dataclass
class Mix:
    """Share of each operation (the rest are lookups) and the longest run of keys per call."""

    store: float = 0.45
    load: float = 0.40
    max_run: int = 6
    hot_share: float = 0.5  #: calls that start in the first quarter of the keys (shared prefixes)


def run_workload(cache: TieredCache, oracle: Oracle, keys: Sequence[BlockKey], *, threads: int = 8,
                 seconds: float = 2.0, max_ops: int | None = None, seed: int = 0, mix: Mix | None = None,
                 stop: threading.Event | None = None) -> None:
    """``threads`` threads calling store/load/lookup on overlapping runs of ``keys`` until time, count
    or ``stop``. Each call is judged by the oracle. Raises if a thread does not finish in time."""
    mix = mix or Mix()
    deadline = time.monotonic() + seconds
    per_thread = None if max_ops is None else max(1, max_ops // threads)
    halt = stop or threading.Event()

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        done = 0
        while not halt.is_set() and time.monotonic() < deadline and (per_thread is None or done < per_thread):
            hot = rng.random() < mix.hot_share
            start = rng.randrange(max(1, len(keys) // 4) if hot else len(keys))
            run = list(keys[start:start + rng.randint(1, mix.max_run)])
            roll = rng.random()
            if roll < mix.store:
                result = oracle.store(cache, run)
            elif roll < mix.store + mix.load:
                result = oracle.load(cache, run)
            else:
                result = oracle.lookup(cache, run)
            done += 1
            if result is None and oracle.hangs:
                return

    pool = [threading.Thread(target=worker, args=(i,), name=f"workload-{i}", daemon=True)
            for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=seconds + oracle.call_timeout + 10)
    stuck = [t.name for t in pool if t.is_alive()]
    if stuck:
        halt.set()
        raise AssertionError(f"workload threads did not finish (deadlock?): {stuck}")


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            return None
        time.sleep(interval)


# --- configuration ------------------------------------------------------------------------------------------
def cache_config(*, file_dir: Path | str | None = None, cpu_blocks: int = 4, file_blocks: int = 16,
                 redis: Mapping[str, Any] | None = None, write_mode: str = "write_back",
                 keep_lower_copy: bool = True, model: str | None = None,
                 **file_options: Any) -> dict[str, Any]:
    """A config of the small model: CPU, then an optional file tier, then an optional Redis tier."""
    tiers: list[dict[str, Any]] = [{"type": "cpu", "capacity": cpu_blocks * BLOCK}]
    if file_dir is not None:
        tiers.append({"type": "file", "path": str(file_dir), "capacity": file_blocks * BLOCK,
                      "io_threads": 4, **file_options})
    if redis is not None:
        tiers.append({"type": "redis", **redis})
    return {"model": {**SMALL_MODEL, "name": model or f"reliability-{uuid.uuid4().hex[:8]}"},
            "hash_block_size": 16, "tiers": tiers,
            "placement": {"write_mode": write_mode, "keep_lower_copy": keep_lower_copy}}


def redis_options(url: str | None = None, *, startup_nodes: list[str] | None = None, timeout: float = 0.5,
                  connect_timeout: float = 0.5, failures: int = 3, cooldown: float = 0.3,
                  **more: Any) -> dict[str, Any]:
    where: dict[str, Any] = ({"cluster": True, "startup_nodes": startup_nodes} if startup_nodes
                             else {"url": url})
    return {**where, "timeout": timeout, "connect_timeout": connect_timeout,
            "circuit_breaker": {"failures": failures, "cooldown_seconds": cooldown}, **more}


def deadline_of(redis: Mapping[str, Any] | None, slack: float = 1.5) -> float:
    """The longest an engine-facing call may take when Redis misbehaves: a lookup's EXISTS, a load's
    GET and a promotion's or demotion's SET can each wait one ``timeout`` (plus connecting), on a
    2-core CI machine with slack."""
    if redis is None:
        return 5.0
    return 3 * (float(redis.get("timeout", 2.0)) + float(redis.get("connect_timeout", 1.0))) + slack


# --- state checks -------------------------------------------------------------------------------------------
def files_on_disk(tier: FileTier) -> tuple[set[BlockKey], list[str]]:
    """(keys of the block files under the tier's namespace directory, names of temporary files)."""
    keys: set[BlockKey] = set()
    temps: list[str] = []
    for dirpath, _, names in os.walk(tier.directory):
        for name in names:
            if name.endswith(TMP_SUFFIX):
                temps.append(os.path.join(dirpath, name))
            elif name.endswith(BLOCK_SUFFIX):
                group = Path(dirpath).parent.name
                keys.add(BlockKey(bytes.fromhex(name[:-len(BLOCK_SUFFIX)]), int(group[1:])))
    return keys, temps


def consistency_problems(cache: TieredCache, *, disk: bool = True) -> list[str]:
    """What disagrees between the cache's index, the tiers and the disk, once the cache is quiet.

    ``disk=False`` skips comparing the file tier's index with the directory (another live process
    may write the same directory).
    """
    problems: list[str] = []
    core = cache.core
    for tier, index in zip(core.tiers, core.residency.tiers, strict=True):
        if index.self_evicting:
            continue
        name = tier.name
        if index.pins:
            problems.append(f"{name}: {len(index.pins)} pins left: {list(index.pins)[:3]}")
        pending = [k for k, state in index.entries.items() if state != READY]
        if pending:
            problems.append(f"{name}: {len(pending)} pending entries left: {pending[:3]}")
        for gid, per_block in index.block_bytes.items():
            count = sum(1 for k in index.entries if k.group_id == gid)
            if index.used[gid] != count * per_block:
                problems.append(f"{name}: group {gid} counts {index.used[gid]} bytes for {count} blocks")
            if index.used[gid] > index.capacity[gid]:
                problems.append(f"{name}: group {gid} holds {index.used[gid]} "
                                f"> capacity {index.capacity[gid]}")
            if len(index.policies[gid]) != count:
                problems.append(f"{name}: eviction policy of group {gid} tracks {len(index.policies[gid])} "
                                f"keys, the index {count}")
        if tier.usage_bytes() != index.usage():
            problems.append(f"{name}: tier says {tier.usage_bytes()} bytes used, "
                            f"the cache's index {index.usage()}")
        held = set(tier.keys())
        if held != set(index.entries):
            only_tier = held - set(index.entries)
            only_index = set(index.entries) - held
            problems.append(f"{name}: tier and index differ: {len(only_tier)} only in the tier, "
                            f"{len(only_index)} only in the index")
        if isinstance(tier, CpuTier):
            problems.extend(f"{name}: {problem}" for problem in tier._slots.problems())
        if isinstance(tier, FileTier) and disk:
            on_disk, temps = files_on_disk(tier)
            if on_disk != held:
                problems.append(f"{name}: {len(on_disk - held)} files not indexed, "
                                f"{len(held - on_disk)} indexed keys without a file")
            if temps:
                problems.append(f"{name}: temporary files left: {temps[:3]}")
    return problems


def tier_stats(cache: TieredCache, name: str) -> Any:
    return next(t for t in cache.stats().tiers if t.name == name)


# --- storage faults -----------------------------------------------------------------------------------------
class SyscallFaults:
    """Make ``os.pwritev``/``os.preadv``/``os.rename`` fail with an errno at a rate (thread-safe).

    ``set("pwritev", errno.ENOSPC, 0.3)`` starts failing 30 % of calls, ``clear()`` heals. Patched on
    the ``os`` module, which is what the file tier calls. Use as a context manager.
    """

    NAMES = ("pwritev", "preadv", "rename")

    def __init__(self) -> None:
        self._original = {name: getattr(os, name) for name in self.NAMES}
        self._rates: dict[str, tuple[int, float]] = {}
        self.injected: dict[str, int] = dict.fromkeys(self.NAMES, 0)
        self._lock = threading.Lock()
        for name in self.NAMES:
            setattr(os, name, self._wrap(name))

    def _wrap(self, name: str) -> Callable[..., Any]:
        original = self._original[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            fault = self._rates.get(name)
            if fault is not None and random.random() < fault[1]:
                with self._lock:
                    self.injected[name] += 1
                raise OSError(fault[0], os.strerror(fault[0]))
            return original(*args, **kwargs)

        return call

    def set(self, name: str, error: int, rate: float) -> None:
        self._rates[name] = (error, rate)

    def clear(self) -> None:
        self._rates.clear()

    def close(self) -> None:
        for name, original in self._original.items():
            setattr(os, name, original)

    def __enter__(self) -> SyscallFaults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CORRUPTIONS = ("flip_header", "flip_payload", "truncate", "zero_header", "other_key", "other_layout",
               "other_namespace", "huge_length")


def forged_value(key: BlockKey, raw: bytes, *, layout_fp: int, raw_len: int | None = None,
                 payload_len: int | None = None, namespace_fp: int = 0) -> bytes:
    """A ``header ‖ payload`` value with a valid checksum whose header says what we want it to."""
    header, payload = encode_block(key, layout_fp, memoryview(raw), namespace_fp=namespace_fp)
    if raw_len is not None or payload_len is not None:
        from kvtier import codec

        fields = list(codec._FIXED.unpack_from(header, 0))
        fields[7] = raw_len if raw_len is not None else fields[7]
        fields[8] = payload_len if payload_len is not None else fields[8]
        fields[9] = 0
        codec._FIXED.pack_into(header, 0, *fields)
        checksum = codec._checksum(header, payload)
        struct.pack_into("<Q", header, codec._CHECKSUM_OFFSET, checksum)
    return bytes(header) + bytes(payload)


def corrupt_bytes(value: bytes, kind: str, key: BlockKey, rng: random.Random, layout_fp: int,
                  header_end: int = HEADER_SIZE) -> bytes:
    """``value`` (a stored ``header ‖ payload``, the header possibly padded to ``header_end``) damaged.

    Kinds: a flipped bit in the header or the payload, truncation, a zeroed header, a valid block of
    another key, a valid block of another layout, a valid block of the same key and layout from
    another namespace (model or TP rank), a valid header claiming a huge length.
    """
    data = bytearray(value)
    if kind == "flip_header":
        data[rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
    elif kind == "flip_payload":
        pos = rng.randrange(header_end, max(header_end + 1, len(data)))
        if pos < len(data):
            data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "zero_header":
        data[:HEADER_SIZE] = bytes(HEADER_SIZE)
    else:
        from kvtier import codec

        raw = expected_bytes(key).numpy().tobytes()
        other = BlockKey(bytes(x ^ 0xFF for x in key.block_hash), key.group_id)
        # the forgery keeps the stored block's namespace: it must be refused for what the kind says
        ns = (codec._NAMESPACE.unpack_from(value, codec._NAMESPACE_OFFSET)[0] if len(value) >= HEADER_SIZE
              else 0)
        if kind == "other_key":
            forged = forged_value(other, expected_bytes(other).numpy().tobytes(), layout_fp=layout_fp,
                                  namespace_fp=ns)
        elif kind == "other_layout":
            forged = forged_value(key, raw, layout_fp=layout_fp ^ 0x5A5A, namespace_fp=ns)
        elif kind == "other_namespace":  # the same key and layout from another model or TP rank
            forged = forged_value(key, raw, layout_fp=layout_fp, namespace_fp=ns ^ 0x5A5A)
        else:  # huge_length
            forged = forged_value(key, raw, layout_fp=layout_fp, raw_len=1 << 40, payload_len=1 << 40,
                                  namespace_fp=ns)
        data = (bytearray(forged[:HEADER_SIZE]) + bytes(header_end - HEADER_SIZE)
                + bytearray(forged[HEADER_SIZE:]))
    return bytes(data)


def corrupt_file(path: str | Path, kind: str, key: BlockKey, rng: random.Random, layout_fp: int) -> bool:
    """Damage a block file in place (``delete`` removes it); False if it vanished first."""
    try:
        if kind == "delete":
            os.unlink(path)
            return True
        with open(path, "rb") as f:
            value = f.read()
        damaged = corrupt_bytes(value, kind, key, rng, layout_fp, header_end=PAGE)
        fd = os.open(path, os.O_WRONLY)  # in place: the inode the tier indexed, no rename
        try:
            os.pwrite(fd, damaged, 0)
            os.ftruncate(fd, len(damaged))
        finally:
            os.close(fd)
        return True
    except FileNotFoundError:
        return False


# --- Redis servers and network faults -----------------------------------------------------------------------
def ping(port: int, host: str = REDIS_HOST, timeout: float = 0.5,
         auth: tuple[str, str] | None = None) -> bool:
    """Whether a Redis answers PING on ``port`` (after ``AUTH user password`` when given)."""
    def command(*args: str) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode())
                                                 for a in args)

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            if auth is not None:
                sock.sendall(command("AUTH", *auth))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(command("PING"))
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_binaries_or_skip() -> None:
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        unavailable("the `redis-server` and `redis-cli` binaries are not on PATH")


@pytest.fixture()
def redis_servers(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """``make(extra_args=(), port=None, auth=None)``: a private redis-server on loopback, killed after the
    test; ``auth`` (user, password) is what the readiness check logs in with."""
    redis_binaries_or_skip()
    made: list[RedisProcess] = []

    def make(extra_args: Sequence[str] = (), port: int | None = None,
             auth: tuple[str, str] | None = None) -> RedisProcess:
        server = RedisProcess(port or free_port(), tmp_path / f"redis-{len(made)}", list(extra_args))
        made.append(server)
        server.start(wait=auth is None)
        if auth is not None and wait_for(lambda: ping(server.port, auth=auth), timeout=10) is None:
            raise RuntimeError(f"redis-server on port {server.port} did not answer an authenticated PING")
        return server

    yield make
    for server in made:
        server.kill()


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Any]:
    """A private 3-master Redis Cluster whose nodes the test may kill."""
    redis_binaries_or_skip()
    handle = start_cluster(tmp_path / "cluster")
    yield handle
    with contextlib.suppress(Exception):
        handle.stop()


class FaultProxy:
    """A loopback TCP proxy in front of ``upstream``; with ``upstream=None``, a server that never answers.

    ``mode``: ``pass`` forwards both ways; ``blackhole`` accepts and reads everything and forwards
    nothing (a cut network that still accepts connections); ``slow`` holds each chunk the server sends
    for ``delay`` seconds. The mode can change while connections are open.
    """

    def __init__(self, upstream: tuple[str, int] | None = None, mode: str = "pass",
                 delay: float = 0.0) -> None:
        self.upstream = upstream
        self.mode = mode if upstream is not None else "blackhole"
        self.delay = delay
        self._listener = socket.create_server((REDIS_HOST, 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="fault-proxy")]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://{REDIS_HOST}:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            client.settimeout(0.1)
            self._sockets.append(client)
            server: socket.socket | None = None
            if self.upstream is not None:
                with contextlib.suppress(OSError):
                    server = socket.create_connection(self.upstream, timeout=1.0)
                    server.settimeout(0.1)
                    self._sockets.append(server)
            for src, dst, replies in ((client, server, False), (server, client, True)):
                if src is None:
                    continue
                t = threading.Thread(target=self._pump, args=(src, dst, replies), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket | None, replies: bool) -> None:
        while not self._closed.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self.mode == "blackhole" or dst is None:
                continue
            if replies and self.mode == "slow":
                time.sleep(self.delay)
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the fault table --------------------------------------------------------------------------------------
@dataclass
class FaultRow:
    """One line of the fault table (``docs/reliability.md``)."""

    scenario: str
    operations: int = 0
    verified: int = 0
    wrong: int = 0
    errors: int = 0
    recover_seconds: float | None = None
    max_call_seconds: float = 0.0
    runs: int = 1
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_oracle(cls, scenario: str, oracle: Oracle, recover_seconds: float | None = None,
                    note: str = "") -> FaultRow:
        return cls(scenario, oracle.operations, oracle.verified, oracle.wrong,
                   len(oracle.errors) + oracle.hangs, recover_seconds, oracle.max_latency,
                   notes=[note] if note else [])

    def merge(self, other: FaultRow) -> None:
        """Accumulate another run of the same scenario (the soak)."""
        self.operations += other.operations
        self.verified += other.verified
        self.wrong += other.wrong
        self.errors += other.errors
        self.max_call_seconds = max(self.max_call_seconds, other.max_call_seconds)
        if other.recover_seconds is not None:
            self.recover_seconds = max(self.recover_seconds or 0.0, other.recover_seconds)
        self.runs += other.runs
        self.notes = other.notes or self.notes


FAULT_TABLE: list[FaultRow] = []


def record(row: FaultRow) -> FaultRow:
    FAULT_TABLE.append(row)
    return row


def format_table(rows: Sequence[FaultRow]) -> str:
    lines = ["| scenario | operations | blocks verified | wrong blocks | errors surfaced | time to recover "
             "| slowest call | notes |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        recover = "—" if r.recover_seconds is None else f"{r.recover_seconds:.2f} s"
        lines.append(f"| {r.scenario} | {r.operations:,} | {r.verified:,} | {r.wrong} | {r.errors} "
                     f"| {recover} | {r.max_call_seconds:.2f} s | {'; '.join(r.notes)} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    target = os.environ.get("KVTIER_FAULT_TABLE")
    if not FAULT_TABLE or (target is None and terminalreporter.config.option.verbose < 1):
        return
    table = format_table(FAULT_TABLE)
    terminalreporter.write_sep("=", "kvtier fault table")
    terminalreporter.write_line(table)
    if target and target != "-":
        Path(target).write_text(table + "\n")
