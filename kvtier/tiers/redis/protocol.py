"""RESP2 over blocking sockets: one connection, a blocking pool per node, and how to open one.

Why hand-written rather than redis-py: a GET's payload (and the reply's closing CRLF) is received
with one ``recvmsg_into(…, MSG_WAITALL)`` straight into the caller's memory, and a SET hands the
caller's memory to ``sendmsg``; redis-py first builds a ``bytes`` per reply (see docs/redis.md).
``benchmarks/bench_redis.py`` keeps measuring this client next to redis-py and valkey-glide.

Only what the tier sends is spoken: bulk, status, integer and error replies, never arrays.
:class:`ReplyError` is the one place an error reply is classified into a counter name.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: Bytes read at once into a connection's own buffer (reply lines, headers, small replies).
_RECV_CHUNK = 16 * 1024
_MAX_LINE = 64 * 1024
CRLF = b"\r\n"
#: Error reply prefix → counter name; anything else is ``server``.
REPLY_ERROR_KINDS = {"MOVED": "moved", "ASK": "ask", "OOM": "oom", "LOADING": "loading",
                     "CLUSTERDOWN": "clusterdown", "MASTERDOWN": "clusterdown", "TRYAGAIN": "clusterdown",
                     "NOAUTH": "auth", "WRONGPASS": "auth", "NOPERM": "auth", "READONLY": "readonly",
                     "BUSY": "busy"}


class ReplyError(Exception):
    """An error reply (``-ERR …``): the connection stays usable."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.kind = REPLY_ERROR_KINDS.get(message.split(" ", 1)[0], "server")
        if "unauthenticated" in message:  # Redis ≥ 7 refuses big requests before AUTH: "Protocol error: …"
            self.kind = "auth"


class ProtocolError(ConnectionError):
    """The byte stream is not the RESP2 we expect: the connection is closed."""


class PoolTimeout(Exception):
    """No pooled connection became free in time (the node is busy, not failing)."""


class Addr(NamedTuple):
    """A node's address, as Redis writes it in ``MOVED``/``ASK`` replies and ``startup_nodes``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Addr | None:
        """``host:port`` or ``[v6]:port`` → Addr; None when it is not one."""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            return None
        return cls(host.strip("[]"), int(port))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Connection:
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
        #: Whether the socket is plain TCP, blocking, with kernel send/receive timeouts (see native_fd).
        self.kernel_timeouts = False

    @property
    def native_fd(self) -> int | None:
        """The descriptor for ``kvtier/kernels/redisio.c``, or None: TLS, no kernel timeouts, or bytes
        buffered here (the helper must start at a reply's first byte)."""
        if not self.kernel_timeouts or self._start != self._end:
            return None
        return self._sock.fileno()

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
        sent = self._sendmsg(parts)  # a blocking socket usually takes it all at once: no views then
        if sent == sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts):
            return
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views:
                views[0] = views[0][sent:]
                sent = self._sendmsg(views)

    def _sendmsg(self, parts: Sequence[bytes | bytearray | memoryview]) -> int:
        try:
            return self._sock.sendmsg(parts)
        except BlockingIOError:
            raise TimeoutError("the server accepted no data within the timeout") from None

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
            nl = self._buf.find(CRLF, self._start, self._end)
            if nl >= 0:
                line = bytes(self._view[self._start:nl])
                self._start = nl + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("reply line longer than 64 KiB")
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

    def read_expected_bulk(self, line: bytes, head: memoryview) -> bool:
        """Consume the next reply's first line and ``head.nbytes`` value bytes into ``head`` if that line is
        exactly ``line`` (``b"$<length>\\r\\n"``); else consume nothing and return False.

        The fast start of a GET whose value length is known: it receives no more than the line and
        ``head`` (the rest can then land straight in the caller's memory) and never waits for a byte
        that another reply (``$-1``, an error, another length) would not send, since every reply line
        ends in CRLF and so differs from ``line`` once it has arrived whole.
        """
        need = len(line) + head.nbytes
        if self._start == self._end:
            self._start = self._end = 0
        while True:
            have = self._end - self._start
            seen = min(have, len(line))
            if self._view[self._start:self._start + seen] != line[:seen]:
                return False
            if have >= need:
                break
            if self._start + need > len(self._buf):
                self._buf[:have] = self._view[self._start:self._end]
                self._start, self._end = 0, have
            self._end += self._recv_into(self._view[self._end:self._start + need])
        start = self._start + len(line)
        head[:] = self._view[start:start + head.nbytes]
        self._start += need
        return True

    def read_value_end(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly, then consume the CRLF that ends the bulk reply.

        With nothing buffered on a plain TCP socket, both land in one ``recvmsg_into(MSG_WAITALL)``:
        the payload in ``dst``, the CRLF in this connection's own buffer (checked like any other).
        """
        if self._start != self._end or not self._waitall:
            self.read_into(dst)
            self.expect_crlf()
            return
        self._start = self._end = 0
        try:
            got, _, _, _ = self._sock.recvmsg_into((dst, self._view[:2]), 0, self._waitall)
        except BlockingIOError:
            raise TimeoutError("no reply within the timeout") from None
        if not got:
            raise ConnectionError("the server closed the connection")
        want = dst.nbytes
        if got < want:  # cut short (a timeout or a signal): the rest, one receive at a time
            self.read_into(dst[got:])
        else:
            self._end = got - want  # the CRLF bytes that came, now buffered
        self.expect_crlf()

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
        if self._view[self._start:self._start + 2] != CRLF:
            raise ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2

    def read_bulk_size(self) -> int:
        """Read a reply line that must start a bulk string: its length, or -1 for nil."""
        line = self.read_line()
        kind = line[:1]
        if kind == b"$":
            try:
                return int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad bulk length {line[:32]!r}") from None
        if kind == b"-":
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"expected a bulk reply, got {line[:32]!r}")

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
                    raise ProtocolError(f"bulk reply of {size} bytes where a small reply was expected")
                data = bytearray(size)
                self.read_into(memoryview(data))
                self.expect_crlf()
                return bytes(data)
        except ValueError:
            raise ProtocolError(f"bad reply {line[:32]!r}") from None
        if kind == b"-":
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"unexpected reply {line[:32]!r}")


def native_refusal(compression: str, tls: bool) -> str | None:
    """Why a tier's raw GETs and SETs cannot go through the native client (``kvtier/kernels/redisio.c``),
    or None where they do: the one rule for the tier and for ``kvtier check``."""
    from kvtier.kernels import host

    if compression != "none":
        return "lz4 is encoded in Python"
    if tls:
        return "TLS"
    if not host.redis_available():
        return host.unavailable_reason or "xxhash exports no XXH3 functions"
    return None


def command(*args: bytes) -> bytes:
    """One request in RESP2 (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class Pool:
    """A thread-safe blocking pool of connections to one node: at most ``size`` open at once."""

    def __init__(self, addr: Addr, size: int, connect: Callable[[Addr], Connection]) -> None:
        self.addr = addr
        self._connect = connect
        self._size = size
        self._cond = threading.Condition()
        self._free = size
        self._idle: list[Connection] = []
        #: every connection open now, idle or busy (a forked child closes its copies of all of them)
        self._open: set[Connection] = set()

    def acquire(self, wait_seconds: float | None) -> Connection | None:
        """A connection (idle or new); ``wait_seconds=None`` returns None at once when all are busy.

        Raises :class:`PoolTimeout` when none frees up in time, and connect errors as they come.
        """
        with self._cond:
            if wait_seconds is None:
                if not self._free:
                    return None
            elif not self._cond.wait_for(lambda: self._free > 0, wait_seconds):
                raise PoolTimeout
            self._free -= 1
            while self._idle:
                conn = self._idle.pop()
                if not conn.stale():
                    return conn
                self._open.discard(conn)
                conn.close()
        try:
            conn = self._connect(self.addr)
        except BaseException:
            self._give_back_slot()
            raise
        with self._cond:
            self._open.add(conn)
        return conn

    def release(self, conn: Connection, reusable: bool) -> None:
        if reusable:
            conn.reused = True
            with self._cond:
                self._idle.append(conn)
        else:
            with self._cond:
                self._open.discard(conn)
            conn.close()
        self._give_back_slot()

    def _give_back_slot(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify()

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of every connection, idle or held by one of
        the parent's I/O threads (the parent's copies stay open), and take every slot back, as those
        threads are not in the child to return theirs; without the lock, which one of them may have
        held at the fork (a new one replaces it)."""
        for conn in self._open:
            conn.close()
        self._open = set()
        self._idle = []
        self._free = self._size
        self._cond = threading.Condition()

    def drop_idle(self) -> None:
        """Close idle connections (after a failure they are probably dead too)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._open.difference_update(idle)
        for conn in idle:
            conn.close()


@dataclass(frozen=True)
class Connector:
    """How to open a connection to any node: credentials, database, TLS and the two timeouts.

    ``connect_timeout`` bounds connecting, the TLS handshake and AUTH/SELECT; ``timeout`` bounds every
    later wait for the network (kernel ``SO_RCVTIMEO``/``SO_SNDTIMEO``).
    """

    username: str | None
    password: str | None
    db: int
    ssl_context: ssl.SSLContext | None
    connect_timeout: float
    timeout: float

    def connect(self, addr: Addr) -> Connection:
        """I/O thread: connect, TLS handshake, AUTH and SELECT within ``connect_timeout``."""
        sock = socket.create_connection((addr.host, addr.port), timeout=self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=addr.host)
            conn = Connection(sock, waitall=self.ssl_context is None)
            setup = []
            if self.password is not None:
                user = (self.username.encode(),) if self.username else ()
                setup.append(command(b"AUTH", *user, self.password.encode()))
            if self.db:
                setup.append(command(b"SELECT", str(self.db).encode()))
            if setup:
                conn.send((b"".join(setup),))
                for _ in setup:
                    conn.read_simple()
            conn.kernel_timeouts = self._set_io_timeout(sock)
        except BaseException:
            sock.close()
            raise
        return conn

    def _set_io_timeout(self, sock: socket.socket) -> bool:
        """Whether the socket got kernel timeouts (else Python's socket timeout bounds each call)."""
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(self.timeout)
            return False
        try:  # blocking mode with kernel timeouts: recv(MSG_WAITALL) then fills a payload in one call
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))
        except OSError:
            sock.settimeout(self.timeout)
            return False
        sock.settimeout(None)
        return True
