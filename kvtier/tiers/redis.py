"""The Redis tier: KV blocks as values in one Redis server or a Redis Cluster, shared by processes.

What it is for: a remote tier that several serving processes (on one machine or many) share. One
value per block, ``codec header ‖ payload`` (lz4 optional), under the key
``kvtier:<namespace>:<group>:<block hash hex>``; a block stored by one process is a hit for every
other process configured with the same namespace. Optional TTL.

What it is not: an index or an eviction policy. Redis owns capacity (``maxmemory`` with
``allkeys-lru``/``allkeys-lfu``, see ``docs/redis.md``); a key Redis dropped is simply a miss. kvtier
keeps no local list of keys that could drift from the server: :meth:`RedisTier.contains` asks Redis,
:meth:`RedisTier.keys` SCANs it, and :meth:`RedisTier.usage_bytes` returns 0 ("unknown").

Data path (measured with ``benchmarks/bench_redis.py``: 2 MiB blocks, batches of 32, loopback):

- GET, SET, EXISTS and UNLINK go through the small RESP2 client of this module, on blocking sockets
  driven by I/O threads, not through redis-py. A GET reply's payload is received with one
  ``recv_into(…, MSG_WAITALL)`` straight into the caller's tensor (only the 128-byte header and, with
  lz4, the compressed payload take a detour); a SET hands the caller's tensor memory to ``sendmsg``.
  The checksum, lz4 and the socket copies run on the I/O threads, which release the GIL. This
  moved ~2.6 GB/s put and ~2.3 GB/s get on a 2-vCPU VM, as fast as ``redis-benchmark``. redis-py
  reads each reply into a fresh ``bytes`` (hiredis: socket → read buffer → parser → ``bytes``), and
  on Python 3.11 its pipelines join every queued command into one buffer first: 0.5 GB/s put and
  0.8 GB/s get pipelined, 1.8 / 1.0 GB/s with a batch overlapped over 4 connections. The same client
  on asyncio non-blocking sockets (``sock_recv_into``) was 25–40 % slower than these threads: every
  partial read went back through the event loop.
- A batch is split per node; each node's share runs over up to ``_STREAMS_PER_NODE`` connections
  (threads) with at most ``_PIPELINE_DEPTH`` block requests in flight on each. Deep pipelines (and
  MGET) of large values are slower: Redis copies every queued reply into its output buffer first.
- Per node, a blocking pool of at most ``max_connections`` connections: a batch waits (up to
  ``timeout``) for a free one instead of failing with "too many connections".
- ``timeout`` bounds every wait for the network (kernel ``SO_RCVTIMEO``/``SO_SNDTIMEO``): a server
  that makes no progress for that long fails the request. ``connect_timeout`` bounds connecting,
  the TLS handshake and AUTH/SELECT.
- redis-py's ``redis.asyncio.cluster.RedisCluster`` reads the cluster topology (CLUSTER SLOTS, startup
  node fallback, auth, TLS); keys are routed by hash slot with redis-py's ``key_slot``. A ``MOVED``
  reply marks the topology stale and retries the block once at the node it names. :meth:`keys` uses a
  short-lived synchronous redis-py client.

Failures never raise into the caller (DESIGN.md §8): a timeout, a refused or reset connection, a dead
cluster node or an error reply turns the affected blocks into misses (``get``, ``contains``) or
``False`` (``put``) and counts the error in :attr:`Tier.counters` (``timeout``, ``connection``,
``corrupt``, ``moved``, ``oom``, ``loading``, ``clusterdown``, ``readonly``, ``auth``, ``server``,
``protocol``, ``topology``, ``pool_timeout``, ``circuit_open``). A per-node :class:`CircuitBreaker`
stops trying a failing node for a cool-down, so a dead server costs nothing per batch; the first
batch after the cool-down probes it, and the tier recovers by itself. A pooled connection that went
stale (server restarted) is replaced and its requests retried once. A value that fails validation
(checksum, key, layout, namespace, length) is a miss and is deleted.

Threads: the coroutines run on the caller's event loop; only the I/O threads touch sockets and only
the event loop touches counters, breakers and the topology. The cluster client belongs to the loop
that created it; a tier moved to another loop makes a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from redis.crc import key_slot

from kvtier.blocks import BlockKey
from kvtier.codec import (
    HEADER_SIZE,
    MAX_HASH_BYTES,
    BlockHeader,
    decode_header,
    decode_payload_into,
    encode_block,
    verify_payload,
)
from kvtier.config import redact_url
from kvtier.errors import CorruptBlock, KVTierConfigError, LayoutMismatch
from kvtier.hashing import namespace_fingerprint
from kvtier.layout import BlockLayout
from kvtier.logs import LogLimiter
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

Compression = Literal["none", "lz4"]

KEY_PREFIX = "kvtier"
DEFAULT_URL = "redis://127.0.0.1:6379/0"
#: Connections (I/O threads) one batch uses per node at most.
_STREAMS_PER_NODE = 4
#: Block requests (GET/SET) in flight per connection; Redis buffers deeper pipelines of big replies.
_PIPELINE_DEPTH = 1
#: Small requests (EXISTS/UNLINK) in flight per connection.
_SMALL_DEPTH = 128
#: Bytes read at once into a connection's own buffer (reply lines, headers, small replies).
_RECV_CHUNK = 16 * 1024
_MAX_LINE = 64 * 1024
#: A stale cluster topology is re-read at most this often.
_TOPOLOGY_REFRESH_SECONDS = 1.0
_CRLF = b"\r\n"
_FORBIDDEN_IN_NAMESPACE = set(" \t\r\n\0{}*?[]\\")
_REPLY_ERROR_KINDS = {"MOVED": "moved", "ASK": "moved", "OOM": "oom", "LOADING": "loading",
                      "CLUSTERDOWN": "clusterdown", "MASTERDOWN": "clusterdown", "TRYAGAIN": "clusterdown",
                      "NOAUTH": "auth", "WRONGPASS": "auth", "NOPERM": "auth", "READONLY": "readonly",
                      "BUSY": "busy"}


# --- circuit breaker ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CircuitBreakerConfig:
    """After ``failures`` consecutive failed attempts, answer at once for ``cooldown_seconds``."""

    failures: int = 5
    cooldown_seconds: float = 5.0

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | CircuitBreakerConfig | None) -> CircuitBreakerConfig:
        """Validate the YAML form ``{failures: 5, cooldown_seconds: 5}``; errors name the key path."""
        if value is None:
            return cls()
        if isinstance(value, CircuitBreakerConfig):
            return value
        unknown = set(value) - {"failures", "cooldown_seconds"}
        if unknown:
            raise KVTierConfigError(f"circuit_breaker.{sorted(unknown)[0]}",
                                    "unknown key (expected failures, cooldown_seconds)")
        failures = value.get("failures", cls.failures)
        cooldown = value.get("cooldown_seconds", cls.cooldown_seconds)
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise KVTierConfigError("circuit_breaker.failures", f"must be an integer ≥ 1, got {failures!r}")
        if isinstance(cooldown, bool) or not isinstance(cooldown, (int, float)) or cooldown < 0:
            raise KVTierConfigError("circuit_breaker.cooldown_seconds",
                                    f"must be a number of seconds ≥ 0, got {cooldown!r}")
        return cls(failures, float(cooldown))


class CircuitBreaker:
    """Closed → open after N consecutive failures → one probe after the cool-down → closed or open.

    Not thread-safe: the tier uses it from its event loop only. ``clock`` is injectable for tests.
    """

    def __init__(self, config: CircuitBreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        """True from the opening failure until a successful probe."""
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether to try now; after the cool-down the first caller becomes the (only) probe."""
        if self._open_until is None:
            return True
        if self._probing or self._clock() < self._open_until:
            return False
        self._probing = True
        return True

    def success(self) -> bool:
        """Record a request that completed; returns True when this closed an open breaker."""
        was_open = self._open_until is not None
        self.consecutive_failures = 0
        self._open_until = None
        self._probing = False
        return was_open

    def failure(self) -> bool:
        """Record a failed attempt; returns True when this opened a closed breaker."""
        self.consecutive_failures += 1
        if self._probing or self.consecutive_failures >= self.config.failures:
            opened = self._open_until is None
            self._open_until = self._clock() + self.config.cooldown_seconds
            self._probing = False
            return opened
        return False

    def end_attempt(self) -> None:
        """Called after every allowed attempt: a probe that recorded nothing lets the next caller probe."""
        self._probing = False


# --- RESP2 over a blocking socket -----------------------------------------------------------------------
class _ReplyError(Exception):
    """An error reply (``-ERR …``): the connection stays usable."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.kind = _REPLY_ERROR_KINDS.get(message.split(" ", 1)[0], "server")
        if "unauthenticated" in message:  # Redis ≥ 7 refuses big requests before AUTH: "Protocol error: …"
            self.kind = "auth"


class _ProtocolError(ConnectionError):
    """The byte stream is not the RESP2 we expect: the connection is closed."""


class _PoolTimeout(Exception):
    """No pooled connection became free in time (the node is busy, not failing)."""


class _Addr(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class _Connection:
    """One RESP2 connection to one node, used by one thread at a time; any I/O error ends it.

    Plain TCP sockets stay in blocking mode with kernel send/receive timeouts, so one
    ``recv_into(MSG_WAITALL)`` fills a whole payload; TLS sockets use Python's socket timeout.
    """

    def __init__(self, sock: socket.socket, waitall: bool) -> None:
        self._sock = sock
        self._waitall = socket.MSG_WAITALL if waitall else 0
        self._buf = bytearray(_MAX_LINE + _RECV_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        #: True once the connection went back to the pool (it may have gone stale since).
        self.reused = False

    def close(self) -> None:
        self._sock.close()

    def stale(self) -> bool:
        """An idle connection with something to read: EOF from a restarted server, or stray bytes."""
        if self._start != self._end or (isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()):
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        if isinstance(self._sock, ssl.SSLSocket):
            for part in parts:
                self._sock.sendall(part)
            return
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            try:
                sent = self._sock.sendmsg(views)
            except BlockingIOError:
                raise TimeoutError("the server accepted no data within the timeout") from None
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]

    def _recv_into(self, view: memoryview, flags: int = 0) -> int:
        try:
            got = self._sock.recv_into(view, 0, flags)
        except BlockingIOError:
            raise TimeoutError("no reply within the timeout") from None
        if not got:
            raise ConnectionError("the server closed the connection")
        return got

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + _RECV_CHUNK > len(self._buf):
            pending = self._end - self._start
            self._buf[:pending] = self._view[self._start:self._end]
            self._start, self._end = 0, pending
        self._end += self._recv_into(self._view[self._end:self._end + _RECV_CHUNK])

    def read_line(self) -> bytes:
        while True:
            nl = self._buf.find(_CRLF, self._start, self._end)
            if nl >= 0:
                line = bytes(self._view[self._start:nl])
                self._start = nl + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise _ProtocolError("reply line longer than 64 KiB")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly: what is buffered first, the rest straight from the socket."""
        want = dst.nbytes
        have = min(self._end - self._start, want)
        if have:
            dst[:have] = self._view[self._start:self._start + have]
            self._start += have
        while have < want:
            have += self._recv_into(dst[have:], self._waitall)

    def skip(self, nbytes: int) -> None:
        while nbytes:
            if self._start == self._end:
                self._fill()
            step = min(nbytes, self._end - self._start)
            self._start += step
            nbytes -= step

    def expect_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start:self._start + 2] != _CRLF:
            raise _ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2

    def read_bulk_size(self) -> int:
        """Read a reply line that must start a bulk string: its length, or -1 for nil."""
        line = self.read_line()
        kind = line[:1]
        if kind == b"$":
            try:
                return int(line[1:])
            except ValueError:
                raise _ProtocolError(f"bad bulk length {line[:32]!r}") from None
        if kind == b"-":
            raise _ReplyError(line[1:].decode("utf-8", "replace"))
        raise _ProtocolError(f"expected a bulk reply, got {line[:32]!r}")

    def read_simple(self) -> bytes | int | None:
        """Read a status, integer, error or small bulk reply (never an array)."""
        line = self.read_line()
        kind = line[:1]
        try:
            if kind == b"+":
                return line[1:]
            if kind == b":":
                return int(line[1:])
            if kind == b"$":
                size = int(line[1:])
                if size < 0:
                    return None
                if size > _MAX_LINE:  # no small reply is this long: never allocate what a server claims
                    raise _ProtocolError(f"bulk reply of {size} bytes where a small reply was expected")
                data = bytearray(size)
                self.read_into(memoryview(data))
                self.expect_crlf()
                return bytes(data)
        except ValueError:
            raise _ProtocolError(f"bad reply {line[:32]!r}") from None
        if kind == b"-":
            raise _ReplyError(line[1:].decode("utf-8", "replace"))
        raise _ProtocolError(f"unexpected reply {line[:32]!r}")


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class _Pool:
    """A thread-safe blocking pool of connections to one node: at most ``size`` open at once."""

    def __init__(self, addr: _Addr, size: int, connect: Callable[[_Addr], _Connection]) -> None:
        self.addr = addr
        self._connect = connect
        self._cond = threading.Condition()
        self._free = size
        self._idle: list[_Connection] = []

    def acquire(self, wait_seconds: float | None) -> _Connection | None:
        """A connection (idle or new); ``wait_seconds=None`` returns None at once when all are busy.

        Raises :class:`_PoolTimeout` when none frees up in time, and connect errors as they come.
        """
        with self._cond:
            if wait_seconds is None:
                if not self._free:
                    return None
            elif not self._cond.wait_for(lambda: self._free > 0, wait_seconds):
                raise _PoolTimeout
            self._free -= 1
            while self._idle:
                conn = self._idle.pop()
                if not conn.stale():
                    return conn
                conn.close()
        try:
            return self._connect(self.addr)
        except BaseException:
            self._give_back_slot()
            raise

    def release(self, conn: _Connection, reusable: bool) -> None:
        if reusable:
            conn.reused = True
            with self._cond:
                self._idle.append(conn)
        else:
            conn.close()
        self._give_back_slot()

    def _give_back_slot(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify()

    def drop_idle(self) -> None:
        """Close idle connections (after a failure they are probably dead too)."""
        with self._cond:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


# --- requests ---------------------------------------------------------------------------------------------
class _Op:
    """One request on one key, run by an I/O thread; ``ok`` is its answer, ``error`` a counter name."""

    __slots__ = ("index", "key", "rkey", "ok", "error", "retried", "redirect")
    #: Whether the request moves a whole block (few in flight) or a few bytes (many in flight).
    large: ClassVar[bool] = False

    def __init__(self, index: int, key: BlockKey, rkey: bytes) -> None:
        self.index = index
        self.key = key
        self.rkey = rkey
        self.ok = False
        self.error: str | None = None
        self.retried = False
        self.redirect: _Addr | None = None

    def send(self, conn: _Connection) -> None:
        raise NotImplementedError

    def read_reply(self, conn: _Connection) -> None:
        raise NotImplementedError

    def reply_error(self, exc: _ReplyError) -> None:
        self.ok = False
        self.error = exc.kind
        word, _, rest = exc.message.partition(" ")
        if word == "MOVED":
            host, sep, port = rest.partition(" ")[2].rpartition(":")
            if sep and port.isdigit():
                self.redirect = _Addr(host, int(port))
        elif exc.kind == "server":
            log.debug("redis answered %s for %s", exc.message, self.key)

    def reset(self) -> None:
        self.ok = False
        self.error = None
        self.redirect = None


class _ExistsOp(_Op):
    __slots__ = ()

    def send(self, conn: _Connection) -> None:
        conn.send((_command(b"EXISTS", self.rkey),))

    def read_reply(self, conn: _Connection) -> None:
        self.ok = conn.read_simple() == 1


class _UnlinkOp(_Op):
    __slots__ = ()

    def send(self, conn: _Connection) -> None:
        conn.send((_command(b"UNLINK", self.rkey),))

    def read_reply(self, conn: _Connection) -> None:
        conn.read_simple()
        self.ok = True


class _SetOp(_Op):
    """SET of ``header ‖ payload``; the value is encoded (checksum, lz4) on the I/O thread."""

    __slots__ = ("raw", "fingerprint", "namespace_fp", "itemsize", "compress", "ttl_args", "value_bytes")
    large = True

    def __init__(self, index: int, key: BlockKey, rkey: bytes, raw: np.ndarray, fingerprint: int, itemsize: int,
                 compress: bool, ttl_args: bytes, namespace_fp: int) -> None:
        super().__init__(index, key, rkey)
        self.raw = raw
        self.fingerprint = fingerprint
        self.namespace_fp = namespace_fp
        self.itemsize = itemsize
        self.compress = compress
        self.ttl_args = ttl_args
        self.value_bytes = 0

    def send(self, conn: _Connection) -> None:
        header, payload = encode_block(self.key, self.fingerprint, self.raw, namespace_fp=self.namespace_fp,
                                       compress=self.compress,
                                       shuffle_itemsize=self.itemsize)
        self.value_bytes = HEADER_SIZE + payload.nbytes
        nargs = 5 if self.ttl_args else 3
        prefix = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(self.rkey), self.rkey, self.value_bytes)
        conn.send((prefix + header, payload, _CRLF + self.ttl_args))

    def read_reply(self, conn: _Connection) -> None:
        self.ok = conn.read_simple() == b"OK"


class _GetOp(_Op):
    """GET into the caller's buffer: the header into a small buffer, a raw payload straight into ``out``."""

    __slots__ = ("out", "fingerprint", "namespace_fp", "itemsize", "header_buf", "value_bytes", "why")
    large = True

    def __init__(self, index: int, key: BlockKey, rkey: bytes, out: np.ndarray, fingerprint: int,
                 itemsize: int, namespace_fp: int) -> None:
        super().__init__(index, key, rkey)
        self.out = out
        self.fingerprint = fingerprint
        self.namespace_fp = namespace_fp
        self.itemsize = itemsize
        self.header_buf = bytearray(HEADER_SIZE)
        self.value_bytes = 0
        self.why = ""

    def send(self, conn: _Connection) -> None:
        conn.send((_command(b"GET", self.rkey),))

    def read_reply(self, conn: _Connection) -> None:
        size = conn.read_bulk_size()
        if size < 0:
            return  # absent, expired or evicted: a plain miss
        self.value_bytes = size
        if size < HEADER_SIZE:
            conn.skip(size + 2)
            self._corrupt(f"value of {size} bytes is shorter than a header")
            return
        conn.read_into(memoryview(self.header_buf))
        try:
            header = decode_header(self.header_buf, expected_key=self.key, expected_layout=self.fingerprint,
                                   expected_raw_len=self.out.nbytes, expected_namespace=self.namespace_fp)
            if HEADER_SIZE + header.payload_len != size:
                raise CorruptBlock(f"value of {size} bytes, header says {HEADER_SIZE + header.payload_len}")
        except CorruptBlock as exc:
            conn.skip(size - HEADER_SIZE + 2)
            self._corrupt(str(exc))
            return
        payload = self.out.data if not header.compressed else memoryview(bytearray(header.payload_len))
        conn.read_into(payload)
        conn.expect_crlf()
        self._decode(header, payload)

    def _decode(self, header: BlockHeader, payload: memoryview) -> None:
        try:
            verify_payload(self.header_buf, header, payload)
            decode_payload_into(header, payload, self.out, self.itemsize)
        except CorruptBlock as exc:
            self._corrupt(str(exc))
            return
        self.ok = True

    def _corrupt(self, why: str) -> None:
        self.why = why  # logged by the event loop, rate-limited
        self.error = "corrupt"


class _NodeRun:
    """One batch's share on one node, shared by its I/O threads (deque and attribute writes are atomic)."""

    __slots__ = ("queue", "errors", "detail", "failed", "succeeded", "cancelled")

    def __init__(self, ops: Sequence[_Op]) -> None:
        self.queue: deque[_Op] = deque(ops)
        #: Connection-level errors (counter names), counted by the event loop afterwards.
        self.errors: list[str] = []
        #: What went wrong last, for the log line when the node's breaker opens.
        self.detail = ""
        self.failed = False
        self.succeeded = False
        self.cancelled = False

    @property
    def stopped(self) -> bool:
        return self.failed or self.cancelled

    def fail(self, kind: str, detail: object) -> None:
        self.errors.append(kind)
        self.detail = f"{kind}: {detail}"
        self.failed = True


def _run_stream(pool: _Pool, run: _NodeRun, depth: int, first: bool, wait_seconds: float) -> None:
    """I/O thread: take requests from the node's queue and run them on one pooled connection.

    The ``first`` stream of a run waits for a connection; the others only take a free one.
    """
    waits = first
    while run.queue and not run.stopped:
        try:
            conn = pool.acquire(wait_seconds if waits else None)
        except _PoolTimeout:
            run.errors.append("pool_timeout")
            return
        except TimeoutError as exc:
            run.fail("timeout", f"connecting: {exc}")
            return
        except _ReplyError as exc:  # AUTH or SELECT refused
            run.fail(exc.kind, exc)
            return
        except OSError as exc:
            run.fail("connection", exc)
            return
        if conn is None:
            return  # the pool is busy: the streams that got a connection do the work
        if not _drive(conn, pool, run, depth):
            return
        waits = True  # it gave requests back to the queue: they must not be left there


def _drive(conn: _Connection, pool: _Pool, run: _NodeRun, depth: int) -> bool:
    """Run queued requests on ``conn``, ``depth`` in flight; True when the stream should reconnect."""
    inflight: deque[_Op] = deque()
    reusable = False
    try:
        while True:
            while not run.stopped and len(inflight) < depth:
                try:
                    op = run.queue.popleft()
                except IndexError:
                    break
                inflight.append(op)
                op.send(conn)
            if not inflight:
                break
            op = inflight[0]
            try:
                op.read_reply(conn)
            except _ReplyError as exc:
                if exc.kind == "auth":  # NOAUTH/NOPERM: no request can succeed here, as with a wrong password
                    for pending in inflight:
                        pending.reset()
                    run.fail("auth", f"{exc.message} (is the password missing from the url or password key?)")
                    return False
                op.reply_error(exc)
            inflight.popleft()
            run.succeeded = True
        reusable = True
        return False
    except OSError as exc:  # timeouts, resets, EOF, TLS errors and protocol errors are all OSErrors
        kind = "timeout" if isinstance(exc, TimeoutError) else (
            "protocol" if isinstance(exc, _ProtocolError) else "connection")
        log.debug("redis %s: %s: %r", pool.addr, kind, exc)
        if conn.reused and kind == "connection" and not any(op.retried for op in inflight):
            for op in reversed(inflight):  # a pooled connection went stale: retry once on a new one
                op.retried = True
                op.reset()
                run.queue.appendleft(op)
            run.errors.append(kind)
            pool.drop_idle()
            return True
        for op in inflight:
            op.reset()
        run.fail(kind, exc)
        return False
    finally:
        pool.release(conn, reusable)


# --- the tier ------------------------------------------------------------------------------------------
class RedisTier(Tier):
    """Blocks as Redis values, on one server (``url``) or a Redis Cluster (``cluster``/``startup_nodes``).

    Construction validates the arguments (raising :class:`KVTierConfigError` with the argument name)
    and opens nothing: connections are made on first use. See the module docstring for the data
    path, the failure behaviour and what Redis (not kvtier) decides. ``capacity_bytes`` is
    informational: the server's ``maxmemory`` decides what stays.

    The keyword arguments are the YAML keys of a ``type: redis`` tier:

    - ``namespace``: part of every key; the cache passes its model/layout fingerprint.
    - ``url``: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS) of a single server.
    - ``cluster``/``startup_nodes``: a Redis Cluster, found through ``["host:port", …]`` (or the
      ``url``'s host); ``startup_nodes`` alone implies ``cluster``.
    - ``username``/``password``: AUTH (they win over the url's); ``tls_ca_file``: CA bundle, turns TLS on.
    - ``ttl_seconds``: expire blocks after this long (``None``: only ``maxmemory`` eviction).
    - ``compression``: ``"lz4"`` (byte-shuffled by the layout's item size) or ``"none"``.
    - ``connect_timeout``, ``timeout``: seconds, see the module docstring.
    - ``max_connections``: per node, shared by concurrent batches.
    - ``circuit_breaker``: ``{"failures": 5, "cooldown_seconds": 5}``, per node.
    """

    kind = "redis"
    self_evicting = True

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout], capacity_bytes: Mapping[int, int] | None = None,
                 *, namespace: str, url: str | None = None, cluster: bool = False,
                 startup_nodes: Sequence[str] | None = None, username: str | None = None,
                 password: str | None = None, tls_ca_file: str | None = None, ttl_seconds: float | None = None,
                 compression: Compression = "none", connect_timeout: float = 1.0, timeout: float = 2.0,
                 max_connections: int = 16,
                 circuit_breaker: Mapping[str, Any] | CircuitBreakerConfig | None = None,
                 namespace_fp: int | None = None) -> None:
        super().__init__(name, layouts, capacity_bytes if capacity_bytes is not None else dict.fromkeys(layouts, 0))
        if not namespace or set(namespace) & _FORBIDDEN_IN_NAMESPACE or not namespace.isprintable():
            raise KVTierConfigError("namespace", f"{namespace!r} must be non-empty printable text without "
                                                 f"whitespace, braces (cluster hash tags) or glob characters")
        if compression not in ("none", "lz4"):
            raise KVTierConfigError("compression", f"must be 'none' or 'lz4', got {compression!r}")
        for what, value in (("connect_timeout", connect_timeout), ("timeout", timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise KVTierConfigError(what, f"must be a positive number of seconds, got {value!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise KVTierConfigError("max_connections", f"must be an integer ≥ 1, got {max_connections!r}")
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float))
                                        or ttl_seconds <= 0):
            raise KVTierConfigError("ttl_seconds", f"must be a positive number of seconds or null, got {ttl_seconds!r}")
        self.namespace = namespace
        #: written into every value's header and checked on every read (another namespace's value is corrupt)
        self.namespace_fp = namespace_fingerprint(namespace) if namespace_fp is None else namespace_fp
        self.compression: Compression = compression
        self.ttl_seconds = ttl_seconds
        self.connect_timeout = float(connect_timeout)
        self.timeout = float(timeout)
        self.max_connections = max_connections
        self.breaker_config = CircuitBreakerConfig.from_mapping(circuit_breaker)
        self._open_nodes: set[object] = set()
        self._corrupt_log = LogLimiter(log, f"invalid values dropped by redis tier {name!r}")

        parsed = urlsplit(url or DEFAULT_URL)
        if parsed.scheme not in ("redis", "rediss"):
            raise KVTierConfigError("url", f"must be redis://host:port/db or rediss://… (TLS), got {redact_url(url or '')!r}")
        try:
            port = parsed.port or 6379
            db = int(parsed.path.strip("/") or 0)
        except ValueError:
            raise KVTierConfigError("url", f"{redact_url(url or '')!r} has a bad port or database number") from None
        self.username = username if username is not None else (unquote(parsed.username) if parsed.username else None)
        self.password = password if password is not None else (unquote(parsed.password) if parsed.password else None)
        self.tls = parsed.scheme == "rediss" or tls_ca_file is not None
        self.tls_ca_file = tls_ca_file
        self.cluster = bool(cluster or startup_nodes)
        self.db = db
        if self.cluster:
            if db:
                raise KVTierConfigError("url", f"Redis Cluster has only database 0, the url names {db}")
            nodes = list(startup_nodes or [f"{parsed.hostname or '127.0.0.1'}:{port}"])
            self.startup_nodes = [_parse_node(node, f"startup_nodes[{i}]") for i, node in enumerate(nodes)]
            self.address: _Addr | None = None
        else:
            self.startup_nodes = []
            self.address = _Addr(parsed.hostname or "127.0.0.1", port)

        self._key_prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self._fingerprints = {gid: layout.fingerprint() for gid, layout in self.layouts.items()}
        self._itemsizes = {gid: layout.itemsize for gid, layout in self.layouts.items()}
        self._ttl_args = b"" if ttl_seconds is None else _ttl_args(ttl_seconds)
        self._ssl_context = ssl.create_default_context(cafile=tls_ca_file) if self.tls else None
        self._pools: dict[_Addr, _Pool] = {}
        self._breakers: dict[_Addr | str, CircuitBreaker] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._cluster_client: Any = None  # redis.asyncio.cluster.RedisCluster, bound to _cluster_loop
        self._cluster_loop: asyncio.AbstractEventLoop | None = None
        self._topology_lock: asyncio.Lock | None = None
        self._topology_stale = False
        self._topology_read_at = float("-inf")

    # --- public API ----------------------------------------------------------------------------------
    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of ``key``: ``kvtier:<namespace>:<group>:<block hash hex>``."""
        return b"%s%d:%s" % (self._key_prefix, key.group_id, key.block_hash.hex().encode())

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """SET one ``header ‖ payload`` value per block (with ``PX`` when a TTL is set).

        Called by the cache to store blocks (Redis makes room itself). Waits until the server
        acknowledged every block; encoding (checksum, lz4) runs on the I/O threads, which read the
        caller's tensors until this returns. A block that was not acknowledged (timeout, dead node,
        ``OOM`` under ``noeviction``, open circuit) is ``False``; the server may or may not hold its
        new value. A key given twice stores its last block. Raises only :class:`LayoutMismatch` or
        ``ValueError`` for wrong arguments.
        """
        self.check_buffers(keys, blocks, "blocks")
        arrays = [self._host_array(block, "blocks") for block in blocks]
        for key in keys:
            if len(key.block_hash) > MAX_HASH_BYTES:
                raise ValueError(f"block hash of {len(key.block_hash)} bytes exceeds {MAX_HASH_BYTES}")
        last = {key: i for i, key in enumerate(keys)}
        if not last:
            return []
        start = time.perf_counter()
        compress = self.compression == "lz4"
        ops = [_SetOp(i, key, self.redis_key(key), arrays[i], self._fingerprints[key.group_id],
                      self._itemsizes[key.group_id], compress, self._ttl_args, self.namespace_fp)
               for key, i in last.items()]
        await self._execute(ops)
        for op in ops:
            if op.ok:
                self.counters.blocks_written += 1
                self.counters.bytes_written += op.value_bytes
        self.counters.write_seconds += time.perf_counter() - start
        stored = {op.key: op.ok for op in ops}
        return [stored[key] for key in keys]

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor]) -> list[bool]:
        """GET each block into ``out[i]``; a raw payload is received straight into ``out[i]``'s memory.

        Called by the cache to load hits. An absent key (never stored, expired or evicted by Redis)
        is a miss; a value that fails validation is a miss and is deleted; a timeout, dead node or
        open circuit is a miss (counted). ``out[i]`` of a miss holds unspecified bytes. Nothing
        writes into ``out`` after this returns, even when it is cancelled. Raises only
        :class:`LayoutMismatch` for wrong buffers.
        """
        self.check_buffers(keys, out, "out")
        arrays = [self._host_array(buf, "out") for buf in out]
        if not keys:
            return []
        start = time.perf_counter()
        ops = [_GetOp(i, key, self.redis_key(key), arrays[i], self._fingerprints[key.group_id],
                      self._itemsizes[key.group_id], self.namespace_fp) for i, key in enumerate(keys)]
        await self._execute(ops)
        for op in ops:
            if op.ok:
                self.counters.blocks_read += 1
                self.counters.bytes_read += op.value_bytes
        self.counters.read_seconds += time.perf_counter() - start
        corrupt = [op for op in ops if op.error == "corrupt"]
        for op in corrupt:
            self._corrupt_log.log("redis tier %r: dropping invalid value of %s: %s", self.name, op.key,
                                  op.why)
        if corrupt:
            await self.delete([op.key for op in corrupt])
        return [op.ok for op in ops]

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """EXISTS for each key, pipelined per node; an unreachable node answers False.

        Called by the cache's lookups (this tier has no local index). A ``True`` may still be a miss
        on ``get`` (Redis can evict in between; a corrupt value is found only when read).
        """
        if not keys:
            return []
        ops = [_ExistsOp(i, key, self.redis_key(key)) for i, key in enumerate(keys)]
        await self._execute(ops)
        return [op.ok for op in ops]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """UNLINK the keys (the server frees memory in the background); failures are counted only."""
        unique = list(dict.fromkeys(keys))
        if unique:
            await self._execute([_UnlinkOp(i, key, self.redis_key(key)) for i, key in enumerate(unique)])

    def keys(self) -> Iterator[BlockKey]:
        """SCAN every primary for this namespace's keys with a synchronous redis-py client.

        For tools and start-up, not for the event loop's hot path: it blocks the calling thread for
        the whole scan. An unreachable node is counted (``connection``) and skipped.
        """
        return iter(list(self._scan_keys()))

    def usage_bytes(self) -> int:
        """0: Redis owns capacity (``INFO memory``, ``maxmemory``); kvtier does not track it."""
        return 0

    async def close(self) -> None:
        """Close idle connections, the I/O threads and the cluster client; a later call reconnects."""
        for pool in self._pools.values():
            pool.drop_idle()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True)
        for pool in self._pools.values():  # connections returned by streams that were finishing
            pool.drop_idle()
        self._corrupt_log.flush()
        client, self._cluster_client = self._cluster_client, None
        if client is not None and self._cluster_loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await _aclose(client)

    # --- execution -----------------------------------------------------------------------------------------
    def _host_array(self, block: torch.Tensor, what: str) -> np.ndarray:
        if block.device.type != "cpu":
            raise LayoutMismatch(f"{what} for redis tier {self.name!r} must be in host memory, got {block.device}")
        return block.numpy()

    def _io_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            threads = min(64, self.max_connections * max(1, len(self.startup_nodes)))
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-redis-{self.name}")
        return self._executor

    def _pool(self, addr: _Addr) -> _Pool:
        pool = self._pools.get(addr)
        if pool is None:
            pool = self._pools[addr] = _Pool(addr, self.max_connections, self._connect)
        return pool

    def _breaker(self, target: _Addr | str) -> CircuitBreaker:
        breaker = self._breakers.get(target)
        if breaker is None:
            breaker = self._breakers[target] = CircuitBreaker(self.breaker_config)
        return breaker

    async def _execute(self, ops: Sequence[_Op]) -> None:
        """Run ops on their nodes concurrently, follow MOVED once, then count the ops' errors."""
        by_node = await self._route(ops)
        await asyncio.gather(*(self._run_node(addr, node_ops) for addr, node_ops in by_node.items()))
        moved = [op for op in ops if op.redirect is not None and not op.retried]
        if moved:
            self.counters.error("moved", len(moved))
            self._topology_stale = True
            again: dict[_Addr, list[_Op]] = {}
            for op in moved:
                assert op.redirect is not None
                again.setdefault(op.redirect, []).append(op)
                op.retried = True
                op.reset()
            await asyncio.gather(*(self._run_node(addr, node_ops) for addr, node_ops in again.items()))
        for op in ops:
            if op.error is not None:
                self.counters.error(op.error)
                if op.error in ("clusterdown", "readonly", "moved"):
                    self._topology_stale = self.cluster

    async def _run_node(self, addr: _Addr, ops: list[_Op]) -> None:
        """One node's share of a batch on up to ``_STREAMS_PER_NODE`` I/O threads; updates its breaker."""
        breaker = self._breaker(addr)
        if not breaker.allow():
            self.counters.error("circuit_open", len(ops))
            return
        run = _NodeRun(ops)
        large = ops[0].large
        streams = min(len(ops), _STREAMS_PER_NODE, self.max_connections) if large else 1
        depth = _PIPELINE_DEPTH if large else _SMALL_DEPTH
        pool = self._pool(addr)
        loop = asyncio.get_running_loop()
        executor = self._io_executor()
        futures = [loop.run_in_executor(executor, _run_stream, pool, run, depth, i == 0, self.timeout)
                   for i in range(streams)]
        try:
            try:
                outcomes = await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))
            except asyncio.CancelledError:
                run.cancelled = True  # the threads stop after their current request …
                await asyncio.wait(futures)  # … and nothing touches the caller's buffers after we return
                raise
            for outcome in outcomes:  # only a bug gets here: I/O faults were turned into errors already
                if isinstance(outcome, BaseException):
                    raise outcome
        finally:
            for kind in run.errors:
                self.counters.error(kind)
            if run.failed:
                if self.cluster:
                    self._topology_stale = True
                if breaker.failure():
                    self._open_nodes.add(addr)
                    self.report_health(False, f"circuit open for {', '.join(sorted(map(str, self._open_nodes)))} "
                                              f"({run.detail}); probing every {self.breaker_config.cooldown_seconds:g} s")
            elif run.succeeded and breaker.success():
                self._open_nodes.discard(addr)
                self.report_health(not self._open_nodes,
                                   f"circuit open for {', '.join(sorted(map(str, self._open_nodes)))}")
            breaker.end_attempt()

    def _connect(self, addr: _Addr) -> _Connection:
        """I/O thread: connect, TLS handshake, AUTH and SELECT within ``connect_timeout``."""
        sock = socket.create_connection((addr.host, addr.port), timeout=self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl_context is not None:
                sock = self._ssl_context.wrap_socket(sock, server_hostname=addr.host)
            conn = _Connection(sock, waitall=self._ssl_context is None)
            setup = []
            if self.password is not None:
                user = (self.username.encode(),) if self.username else ()
                setup.append(_command(b"AUTH", *user, self.password.encode()))
            if self.db:
                setup.append(_command(b"SELECT", str(self.db).encode()))
            if setup:
                conn.send((b"".join(setup),))
                for _ in setup:
                    conn.read_simple()
            self._set_io_timeout(sock)
        except BaseException:
            sock.close()
            raise
        return conn

    def _set_io_timeout(self, sock: socket.socket) -> None:
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(self.timeout)
            return
        try:  # blocking mode with kernel timeouts: recv(MSG_WAITALL) then fills a payload in one call
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))
        except OSError:
            sock.settimeout(self.timeout)
        else:
            sock.settimeout(None)

    # --- cluster topology ----------------------------------------------------------------------------
    async def _route(self, ops: Sequence[_Op]) -> dict[_Addr, list[_Op]]:
        if not self.cluster:
            assert self.address is not None
            return {self.address: list(ops)}
        client = await self._topology()
        by_node: dict[_Addr, list[_Op]] = {}
        if client is None:
            return by_node
        uncovered = 0
        for op in ops:
            try:
                node = client.nodes_manager.get_node_from_slot(key_slot(op.rkey))
            except Exception:  # SlotNotCoveredError: part of the cluster is unknown right now
                uncovered += 1
                continue
            by_node.setdefault(_Addr(node.host, int(node.port)), []).append(op)
        if uncovered:
            self.counters.error("topology", uncovered)
            self._topology_stale = True
        return by_node

    async def _topology(self) -> Any:
        """The cluster client with its slot map: read on first use, re-read (rate-limited) when stale."""
        loop = asyncio.get_running_loop()
        if self._cluster_loop is not loop:  # first use, or the tier moved to another event loop
            self._cluster_client, self._cluster_loop = None, loop
            self._topology_lock = asyncio.Lock()
        client = self._cluster_client
        now = time.monotonic()
        if client is not None and not (self._topology_stale
                                       and now - self._topology_read_at >= _TOPOLOGY_REFRESH_SECONDS):
            return client
        breaker = self._breaker("topology")
        if not breaker.allow():
            if client is None:
                self.counters.error("circuit_open")
            return client
        assert self._topology_lock is not None
        try:
            async with self._topology_lock:
                if self._cluster_client is not None and self._topology_read_at >= now:
                    return self._cluster_client  # another batch re-read it while we waited
                budget = self.connect_timeout * (len(self.startup_nodes) + 1) + self.timeout
                try:
                    if self._cluster_client is None:
                        fresh = self._new_cluster_client()
                        try:
                            await asyncio.wait_for(fresh.initialize(), budget)
                        except BaseException:
                            with contextlib.suppress(Exception):
                                await _aclose(fresh)
                            raise
                        self._cluster_client = fresh
                    else:
                        await asyncio.wait_for(self._cluster_client.nodes_manager.initialize(), budget)
                except Exception as exc:
                    self.counters.error("topology")
                    self._topology_read_at = time.monotonic()
                    if breaker.failure():
                        log.warning("redis tier %r: cannot read the cluster topology from %s (%s); "
                                    "retrying in %.1f s", self.name, [str(a) for a in self.startup_nodes],
                                    exc, self.breaker_config.cooldown_seconds)
                    return self._cluster_client
                self._topology_stale = False
                self._topology_read_at = time.monotonic()
                breaker.success()
                return self._cluster_client
        finally:
            breaker.end_attempt()

    def _new_cluster_client(self) -> Any:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.tls_ca_file} if self.tls else {}
        return RedisCluster(
            startup_nodes=[ClusterNode(addr.host, addr.port) for addr in self.startup_nodes],
            username=self.username, password=self.password, require_full_coverage=False,
            socket_connect_timeout=self.connect_timeout, socket_timeout=self.timeout, max_connections=4,
            decode_responses=False, **tls)

    def _scan_keys(self) -> Iterator[BlockKey]:
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.tls_ca_file} if self.tls else {}
        common: dict[str, Any] = dict(username=self.username, password=self.password,
                                      socket_connect_timeout=self.connect_timeout, socket_timeout=self.timeout, **tls)
        pattern = self._key_prefix + b"*"
        clients: list[Any] = []
        cluster_client = None
        try:
            if self.cluster:
                cluster_client = RedisCluster(startup_nodes=[ClusterNode(a.host, a.port) for a in self.startup_nodes],
                                              require_full_coverage=False, **common)
                clients = [cluster_client.get_redis_connection(node) for node in cluster_client.get_primaries()]
            else:
                assert self.address is not None
                clients = [redis.Redis(host=self.address.host, port=self.address.port, db=self.db, **common)]
        except Exception as exc:  # redis.RedisError, or RedisClusterException (not a RedisError)
            self.counters.error("connection")
            log.warning("redis tier %r: cannot list keys: %s", self.name, exc)
        for client in clients:
            try:
                for rkey in client.scan_iter(match=pattern, count=1000):
                    key = self._parse_redis_key(rkey)
                    if key is not None:
                        yield key
            except redis.RedisError as exc:
                self.counters.error("connection")
                log.warning("redis tier %r: listing keys failed on a node: %s", self.name, exc)
            finally:
                if cluster_client is None:
                    client.close()
        if cluster_client is not None:
            cluster_client.close()

    def _parse_redis_key(self, rkey: bytes) -> BlockKey | None:
        group, sep, hex_hash = rkey[len(self._key_prefix):].partition(b":")
        try:
            return BlockKey(bytes.fromhex(hex_hash.decode()), int(group)) if sep else None
        except ValueError:
            return None


def _parse_node(node: str, path: str) -> _Addr:
    host, sep, port = str(node).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KVTierConfigError(path, f"must be host:port, got {node!r}")
    return _Addr(host.strip("[]"), int(port))


def _ttl_args(ttl_seconds: float) -> bytes:
    millis = str(max(1, round(ttl_seconds * 1000))).encode()
    return b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(millis), millis)


async def _aclose(client: Any) -> None:
    close = getattr(client, "aclose", None) or client.close
    await close()


__all__ = ["CircuitBreaker", "CircuitBreakerConfig", "Compression", "RedisTier"]
