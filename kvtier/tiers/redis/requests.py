"""The requests of a batch (one per block) and the I/O-thread loop that runs a node's share of them.

A batch becomes one :class:`Op` per key; the tier groups them per node into a :class:`NodeRun`,
whose queue up to a few I/O threads drain (:func:`run_stream`), each on its own pooled connection
with a bounded number of requests in flight. The threads touch sockets and the ops only; the event
loop reads the outcome afterwards (``ok``, ``error``, ``redirect``) and owns counters and breakers.

Encoding (checksum, lz4) and decoding run on these threads, which release the GIL in the socket
calls, lz4 and the checksum. A GET's raw payload lands in the caller's memory with no copy between.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from kvtier.blocks import BlockKey
from kvtier.codec import (
    HEADER_SIZE,
    BlockHeader,
    PayloadChecksum,
    RawHeaders,
    decode_header,
    decode_payload_into,
    encode_block,
    finish_raw_check,
    start_raw_check,
    verify_payload,
)
from kvtier.errors import CorruptBlock
from kvtier.tiers.redis.protocol import (
    CRLF,
    Addr,
    Connection,
    Pool,
    PoolTimeout,
    ProtocolError,
    ReplyError,
    command,
)

log = logging.getLogger(__name__)

_ASKING = command(b"ASKING")
#: A GET's raw payload is received and hashed in pieces of this size: each is hashed right after it
#: lands, while it is in the CPU cache, instead of reading the whole block back from memory after.
_HASH_PIECE = 256 * 1024


class Op:
    """One request on one key, run by an I/O thread; ``ok`` is its answer, ``error`` a counter name.

    A ``MOVED`` or ``ASK`` reply leaves the node to retry at in ``redirect``; an op retried after
    ``ASK`` is sent behind ``ASKING`` (``asking``), which lets the importing node answer for one
    command during a slot migration without the client changing its slot map.
    """

    __slots__ = ("index", "key", "rkey", "ok", "error", "retried", "redirect", "asking")
    #: Whether the request moves a whole block (few in flight) or a few bytes (many in flight).
    large: ClassVar[bool] = False

    def __init__(self, index: int, key: BlockKey, rkey: bytes) -> None:
        self.index = index
        self.key = key
        self.rkey = rkey
        self.ok = False
        self.error: str | None = None
        self.retried = False
        self.redirect: Addr | None = None
        self.asking = False

    def parts(self) -> tuple[bytes | memoryview, ...]:
        """The request's bytes, in pieces handed to ``sendmsg`` as they are."""
        raise NotImplementedError

    def read_reply(self, conn: Connection) -> None:
        raise NotImplementedError

    def send(self, conn: Connection) -> None:
        parts = self.parts()
        conn.send((_ASKING, *parts) if self.asking else parts)

    def receive(self, conn: Connection) -> None:
        """Read this request's reply (and ``ASKING``'s before it); an error reply becomes ``error``."""
        if self.asking:
            try:
                conn.read_simple()
            except ReplyError as exc:  # the command's own reply follows and tells the same story
                log.debug("redis refused ASKING for %s: %s", self.key, exc.message)
        try:
            self.read_reply(conn)
        except ReplyError as exc:
            if exc.kind == "auth":  # NOAUTH/NOPERM: no request can succeed here; the stream stops (_drive)
                raise
            self.reply_error(exc)

    def reply_error(self, exc: ReplyError) -> None:
        self.ok = False
        self.error = exc.kind
        if exc.kind in ("moved", "ask"):  # "MOVED 3999 127.0.0.1:6381"
            self.redirect = Addr.parse(exc.message.split(" ")[-1])
        elif exc.kind == "server":
            log.debug("redis answered %s for %s", exc.message, self.key)

    def reset(self) -> None:
        self.ok = False
        self.error = None
        self.redirect = None


class ExistsOp(Op):
    __slots__ = ()

    def parts(self) -> tuple[bytes | memoryview, ...]:
        return (command(b"EXISTS", self.rkey),)

    def read_reply(self, conn: Connection) -> None:
        self.ok = conn.read_simple() == 1


class UnlinkOp(Op):
    __slots__ = ()

    def parts(self) -> tuple[bytes | memoryview, ...]:
        return (command(b"UNLINK", self.rkey),)

    def read_reply(self, conn: Connection) -> None:
        conn.read_simple()
        self.ok = True


class SetOp(Op):
    """SET of ``header ‖ payload``; the value is encoded (checksum, lz4) on the I/O thread."""

    __slots__ = ("raw", "fingerprint", "namespace_fp", "itemsize", "compress", "ttl_args", "value_bytes")
    large = True

    def __init__(self, index: int, key: BlockKey, rkey: bytes, raw: np.ndarray, fingerprint: int,
                 itemsize: int, compress: bool, ttl_args: bytes, namespace_fp: int) -> None:
        super().__init__(index, key, rkey)
        self.raw = raw
        self.fingerprint = fingerprint
        self.namespace_fp = namespace_fp
        self.itemsize = itemsize
        self.compress = compress
        self.ttl_args = ttl_args
        self.value_bytes = 0

    def parts(self) -> tuple[bytes | memoryview, ...]:
        header, payload = encode_block(self.key, self.fingerprint, self.raw, namespace_fp=self.namespace_fp,
                                       compress=self.compress, shuffle_itemsize=self.itemsize)
        self.value_bytes = HEADER_SIZE + payload.nbytes
        nargs = 5 if self.ttl_args else 3
        prefix = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
            nargs, len(self.rkey), self.rkey, self.value_bytes)
        return prefix + header, payload, CRLF + self.ttl_args

    def read_reply(self, conn: Connection) -> None:
        self.ok = conn.read_simple() == b"OK"


class GetOp(Op):
    """GET into the caller's buffer: the header into a small buffer, a raw payload straight into ``out``.

    The reply a raw block of this layout makes (``$<header + block bytes>``, then the value) is read
    on the fast path: its length line and header in one receive, the header compared byte for byte
    with the one this key would have (:class:`RawHeaders`), then the payload and the closing CRLF
    straight into ``out`` and hashed there. Any other reply (a miss, an error, another length, a
    compressed or foreign value) is parsed the general way; what fails a check is a miss.
    """

    __slots__ = ("out", "fingerprint", "namespace_fp", "itemsize", "raw_headers", "header_buf", "value_bytes",
                 "why")
    large = True

    def __init__(self, index: int, key: BlockKey, rkey: bytes, out: np.ndarray, fingerprint: int,
                 itemsize: int, namespace_fp: int, raw_headers: RawHeaders) -> None:
        super().__init__(index, key, rkey)
        self.out = out
        self.fingerprint = fingerprint
        self.namespace_fp = namespace_fp
        self.itemsize = itemsize
        self.raw_headers = raw_headers
        self.header_buf = bytearray(HEADER_SIZE)
        self.value_bytes = 0
        #: Why the value was invalid; logged (rate-limited) by the event loop, not the I/O thread.
        self.why = ""

    def parts(self) -> tuple[bytes | memoryview, ...]:
        return (command(b"GET", self.rkey),)

    def read_reply(self, conn: Connection) -> None:
        raw_size = HEADER_SIZE + self.out.nbytes
        header_view = memoryview(self.header_buf)
        if conn.read_expected_bulk(b"$%d\r\n" % raw_size, header_view):
            size = raw_size
        else:
            size = conn.read_bulk_size()
            if size < 0:
                return  # absent, expired or evicted: a plain miss
            if size < HEADER_SIZE:
                self.value_bytes = size
                conn.skip(size + 2)
                self._corrupt(f"value of {size} bytes is shorter than a header")
                return
            conn.read_into(header_view)
        self.value_bytes = size
        digest = start_raw_check(header_view, self.raw_headers.of(self.key)) if size == raw_size else None
        if digest is None:
            self._read_other(conn, size)
            return
        # a raw payload lands in ``out`` piece by piece, each hashed while it is still in the CPU cache
        out = self.out.data
        total = out.nbytes
        for start in range(0, total, _HASH_PIECE):
            piece = out[start:start + _HASH_PIECE]
            if start + _HASH_PIECE >= total:
                conn.read_value_end(piece)
            else:
                conn.read_into(piece)
            digest.update(piece)
        if total == 0:
            conn.expect_crlf()
        if not finish_raw_check(header_view, digest):
            self._corrupt(f"checksum mismatch for {self.key}")
            return
        self.ok = True

    def _read_other(self, conn: Connection, size: int) -> None:
        """The rest of a value that is not this key's raw block: a compressed block, or a miss."""
        try:
            header = self._check_header(size)
        except CorruptBlock as exc:
            conn.skip(size - HEADER_SIZE + 2)
            self._corrupt(str(exc))
            return
        if not header.compressed:  # valid, yet not byte for byte the expected header: checked in full
            running = PayloadChecksum(self.header_buf, header)
            conn.read_value_end(self.out.data)
            running.update(self.out.data)
            try:
                running.verify()
            except CorruptBlock as exc:
                self._corrupt(str(exc))
                return
            self.ok = True
            return
        payload = memoryview(bytearray(header.payload_len))
        conn.read_into(payload)
        conn.expect_crlf()
        self._decode(header, payload)

    def _check_header(self, size: int) -> BlockHeader:
        """The one place a value's header is checked: key, layout, namespace, length; raises CorruptBlock."""
        header = decode_header(self.header_buf, expected_key=self.key, expected_layout=self.fingerprint,
                               expected_raw_len=self.out.nbytes, expected_namespace=self.namespace_fp)
        if HEADER_SIZE + header.payload_len != size:
            raise CorruptBlock(f"value of {size} bytes, header says {HEADER_SIZE + header.payload_len}")
        return header

    def _decode(self, header: BlockHeader, payload: memoryview) -> None:
        """A compressed payload: verify, then decompress into ``out``."""
        try:
            verify_payload(self.header_buf, header, payload)
            decode_payload_into(header, payload, self.out, self.itemsize)
        except CorruptBlock as exc:
            self._corrupt(str(exc))
            return
        self.ok = True

    def _corrupt(self, why: str) -> None:
        self.why = why
        self.error = "corrupt"


class NodeRun:
    """One batch's share on one node, shared by its I/O threads (deque and attribute writes are atomic)."""

    __slots__ = ("queue", "errors", "detail", "failed", "succeeded", "cancelled")

    def __init__(self, ops: Sequence[Op]) -> None:
        self.queue: deque[Op] = deque(ops)
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


def run_stream(pool: Pool, run: NodeRun, depth: int, first: bool, wait_seconds: float) -> None:
    """I/O thread: take requests from the node's queue and run them on one pooled connection.

    The ``first`` stream of a run waits for a connection; the others only take a free one.
    """
    waits = first
    while run.queue and not run.stopped:
        try:
            conn = pool.acquire(wait_seconds if waits else None)
        except PoolTimeout:
            run.errors.append("pool_timeout")
            return
        except TimeoutError as exc:
            run.fail("timeout", f"connecting: {exc}")
            return
        except ReplyError as exc:  # AUTH or SELECT refused
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


def _drive(conn: Connection, pool: Pool, run: NodeRun, depth: int) -> bool:
    """Run queued requests on ``conn``, ``depth`` in flight; True when the stream should reconnect."""
    inflight: deque[Op] = deque()
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
            try:
                inflight[0].receive(conn)
            except ReplyError as exc:  # auth refused on a command: as with a wrong password, the node fails
                for pending in inflight:
                    pending.reset()
                run.fail("auth", f"{exc.message} (is the password missing from the url or password key?)")
                return False
            inflight.popleft()
            run.succeeded = True
        reusable = True
        return False
    except OSError as exc:  # timeouts, resets, EOF, TLS errors and protocol errors are all OSErrors
        kind = "timeout" if isinstance(exc, TimeoutError) else (
            "protocol" if isinstance(exc, ProtocolError) else "connection")
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

