"""The requests of a batch (one per block) and the I/O-thread loop that runs a node's share of them.

A batch becomes one :class:`Op` per key; the tier groups them per node into a :class:`NodeRun`,
whose queue up to a few I/O threads drain (:func:`run_stream`), each on its own pooled connection
with a bounded number of requests in flight. The threads touch sockets and the ops only; the event
loop reads the outcome afterwards (``ok``, ``error``, ``redirect``) and owns counters and breakers.

Encoding (checksum, lz4) and decoding run on these threads, which release the GIL in the socket
calls, lz4 and the checksum. A GET's raw payload lands in the caller's memory with no copy between.
Where the native helper is built (``kvtier/kernels/redisio.c``), a thread hands a run of raw GETs or
SETs to it in one call that holds no GIL; what the helper does not decide is sent again here.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, cast

import numpy as np

from kvtier.blocks import BlockKey
from kvtier.codec import (
    CHECKSUM_OFFSET,
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
from kvtier.kernels import host
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
#: Requests one call of the native helper runs at most (a stream takes its share of the queue in
#: runs of up to this many, so the node's streams stay balanced).
_NATIVE_RUN = 16


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

    def settle_native(self, code: int) -> bool:
        """Take the native helper's status for this request (``host.REDIS_*``); False: not decided."""
        raise NotImplementedError


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

    __slots__ = ("raw", "fingerprint", "namespace_fp", "itemsize", "compress", "ttl_args", "value_bytes",
                 "raw_headers")
    large = True

    def __init__(self, index: int, key: BlockKey, rkey: bytes, raw: np.ndarray, fingerprint: int,
                 itemsize: int, compress: bool, ttl_args: bytes, namespace_fp: int,
                 raw_headers: RawHeaders) -> None:
        super().__init__(index, key, rkey)
        self.raw = raw
        self.raw_headers = raw_headers
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

    def settle_native(self, code: int) -> bool:
        if code != host.REDIS_OK:
            return False
        self.ok = True
        self.value_bytes = HEADER_SIZE + self.raw.nbytes
        return True


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

    def settle_native(self, code: int) -> bool:
        if code == host.REDIS_ABSENT:
            return True
        if code not in (host.REDIS_OK, host.REDIS_CORRUPT):
            return False
        self.value_bytes = HEADER_SIZE + self.out.nbytes
        if code == host.REDIS_OK:
            self.ok = True
        else:
            self._corrupt(f"checksum mismatch for {self.key}")
        return True

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


class NativeOutcome(NamedTuple):
    """What one call of the native helper left to do (the ops it decided are settled already)."""

    #: replies read but not decided there (a compressed or foreign value): sent again the long way
    again: list[Op]
    #: not sent, or no reply read: their outcome is unknown
    not_done: list[Op]
    #: the call's first error reply (it sent nothing after it), for the caller to classify
    refused: tuple[Op, ReplyError] | None
    #: the connection failed, as the error the Python client raises for it
    failure: OSError | None


def run_native(fd: int, ops: list[Op], depth: int, stop: np.ndarray) -> NativeOutcome:
    """Run raw GETs or SETs (all one kind, all :func:`native_ready`) on the socket ``fd`` in one call of
    the native helper (``kvtier/kernels/redisio.c``); the ops it decided are settled on return."""
    keys = [op.rkey for op in ops]
    if isinstance(ops[0], GetOp):
        gets = cast("list[GetOp]", ops)
        addresses, sizes = _addresses([op.out for op in gets])
        expected = b"".join([op.raw_headers.of(op.key) for op in gets])
        result = host.redis_get(fd, keys, addresses, sizes, _HASH_PIECE, expected, HEADER_SIZE,
                                CHECKSUM_OFFSET, depth, stop)
    else:
        sets = cast("list[SetOp]", ops)
        addresses, sizes = _addresses([op.raw for op in sets])
        expected = b"".join([op.raw_headers.of(op.key) for op in sets])
        tail = sets[0].ttl_args
        result = host.redis_set(fd, keys, addresses, sizes, expected, HEADER_SIZE, CHECKSUM_OFFSET, tail,
                                5 if tail else 3, depth, stop)
    assert result is not None, "run_native without the helper (NodeRun.native is set only where it is built)"
    rc, status, refusal = result
    again: list[Op] = []
    not_done: list[Op] = []
    refused: tuple[Op, ReplyError] | None = None
    for op, code in zip(ops, status.tolist(), strict=True):
        if code == host.REDIS_NOT_DONE:
            not_done.append(op)
        elif code == host.REDIS_REFUSED:
            refused = (op, ReplyError(refusal))
        elif not op.settle_native(code):
            again.append(op)
    failure: OSError | None = None
    if rc < 0:
        what = f"native redis client: {host.REDIS_FAILURES.get(rc, f'error {rc}')}"
        failure = (TimeoutError(what) if rc == -1 else ProtocolError(what) if rc == -3
                   else ConnectionError(what))
    return NativeOutcome(again, not_done, refused, failure)


def _addresses(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The arrays' addresses (``uint64``) and sizes in bytes (``int64``), for the native helper."""
    return (np.array([array.ctypes.data for array in arrays], dtype=np.uint64),
            np.array([array.nbytes for array in arrays], dtype=np.int64))


def native_ready(op: Op) -> bool:
    """Whether the native helper can run ``op``: a raw GET into, or SET from, contiguous host memory."""
    if op.asking:
        return False
    if isinstance(op, GetOp):
        return bool(op.out.flags.c_contiguous and op.out.flags.writeable)
    if isinstance(op, SetOp):
        return not op.compress and bool(op.raw.flags.c_contiguous)
    return False


class NodeRun:
    """One batch's share on one node, shared by its I/O threads (deque and attribute writes are atomic).

    ``native``: its requests may go to the native helper (raw GETs or SETs, the helper built).
    """

    __slots__ = ("queue", "errors", "detail", "failed", "succeeded", "cancelled", "native", "native_run",
                 "stop")

    def __init__(self, ops: Sequence[Op], native: bool = False, streams: int = 1) -> None:
        self.queue: deque[Op] = deque(ops)
        self.native = native
        #: requests a stream hands to the native helper at once: its share of the queue, at most _NATIVE_RUN
        self.native_run = max(1, min(_NATIVE_RUN, -(-len(ops) // max(1, streams))))
        #: Connection-level errors (counter names), counted by the event loop afterwards.
        self.errors: list[str] = []
        #: What went wrong last, for the log line when the node's breaker opens.
        self.detail = ""
        self.failed = False
        self.succeeded = False
        self.cancelled = False
        #: set with ``failed`` or ``cancelled``: the native helper sends nothing more once it is non-zero
        self.stop = np.zeros(1, dtype=np.int32)

    @property
    def stopped(self) -> bool:
        return self.failed or self.cancelled

    def fail(self, kind: str, detail: object) -> None:
        self.errors.append(kind)
        self.detail = f"{kind}: {detail}"
        self.failed = True
        self.stop[0] = 1

    def cancel(self) -> None:
        """The caller gave up: the streams stop after the requests already sent."""
        self.cancelled = True
        self.stop[0] = 1

    def take(self, most: int) -> list[Op]:
        """Up to ``most`` queued requests (other streams take from the same queue at once)."""
        taken: list[Op] = []
        try:
            while len(taken) < most:
                taken.append(self.queue.popleft())
        except IndexError:
            pass
        return taken


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
    """Run queued requests on ``conn``, ``depth`` in flight; True when the stream should reconnect.

    With ``run.native`` and a plain socket, queued requests go to the native helper a run at a time;
    those it hands back (and any it cannot take) are sent here, the long way, on the same connection.
    """
    inflight: deque[Op] = deque()
    again: deque[Op] = deque()
    fd = conn.native_fd if run.native else None
    reusable = False
    try:
        while True:
            while not run.stopped and len(inflight) < depth:
                if again:
                    op = again.popleft()
                elif fd is not None:
                    if inflight or not _native_step(fd, run, depth, inflight, again):
                        break
                    continue
                else:
                    try:
                        op = run.queue.popleft()
                    except IndexError:
                        break
                inflight.append(op)
                op.send(conn)
            if not inflight:
                break
            inflight[0].receive(conn)
            inflight.popleft()
            run.succeeded = True
        reusable = True
        return False
    except ReplyError as exc:  # auth refused on a command: as with a wrong password, the node fails
        for pending in inflight:
            pending.reset()
        run.fail("auth", f"{exc.message} (is the password missing from the url or password key?)")
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


def _native_step(fd: int, run: NodeRun, depth: int, inflight: deque[Op], again: deque[Op]) -> bool:
    """Take a run of queued requests and hand it to the native helper; False when the queue was empty.

    What the helper did not decide joins ``again``; the requests after an error reply go back to the
    front of the queue. On a failed connection or an auth error, every request not settled is put in
    ``inflight`` (for ``_drive``'s handlers) and the error is raised.
    """
    batch = run.take(run.native_run)
    if not batch:
        return False
    ready: list[Op] = []
    for op in batch:
        (ready if native_ready(op) else again).append(op)
    if not ready:
        return True
    outcome = run_native(fd, ready, depth, run.stop)
    run.succeeded = run.succeeded or len(outcome.not_done) < len(ready)
    again.extend(outcome.again)
    stop: OSError | ReplyError | None = outcome.failure
    if outcome.refused is not None:
        op, exc = outcome.refused
        if exc.kind == "auth" and stop is None:
            stop = exc
            again.append(op)
        else:
            op.reply_error(exc)
    if stop is not None:
        inflight.extend(again)
        inflight.extend(outcome.not_done)
        again.clear()
        raise stop
    run.queue.extendleft(reversed(outcome.not_done))
    return True
