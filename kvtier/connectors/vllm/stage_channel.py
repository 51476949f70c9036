"""The stage channel: how vLLM's scheduler asks every worker process to stage slow-tier blocks.

With the workers in processes of their own (tensor parallelism, the multiprocess executor), a file
or Redis block can be lost on one rank alone (a deleted or corrupt file, a Redis eviction), and vLLM
0.32 cannot fail a load. So the manager promises such a block only once every rank has read it,
verified, into memory and pinned it there until the load that reads it (docs/vllm.md, "Tensor
parallel and several processes"). Each worker serves a Unix socket named from vLLM's ``engine_id``
and its rank, as LMCache's lookup server does; the manager sends each rank one request per
scheduler step with every chain to stage and every staged copy to release, and waits on a thread of
its own, never on the engine's. A rank that does not answer in time makes the round a miss.

Messages are length-prefixed JSON (block hashes in hex): ``{"stage": [[[hash, group], ...], ...],
"release": [[hash, group], ...]}`` → ``{"staged": [[count, lost], ...]}``: per chain how many
leading blocks are staged and pinned, and whether the next one is missing or corrupt on that rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import queue
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.blocks import BlockKey

log = logging.getLogger(__name__)

#: seconds the manager waits for every rank's answer before the round is a miss
DEFAULT_STAGE_TIMEOUT = 10.0
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 256 << 20


def socket_path(engine_id: str, rank: int, directory: str | None = None) -> str:
    """The Unix socket of ``rank``'s worker of engine ``engine_id`` (short: socket paths are ≤ 107 bytes)."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(directory or tempfile.gettempdir(), f"kvtier-stage-{digest}-{rank}.sock")


def _encode(keys: Sequence[BlockKey]) -> list[list[object]]:
    return [[key.block_hash.hex(), key.group_id] for key in keys]


def _decode(items: object, what: str) -> list[BlockKey]:
    if not isinstance(items, list):
        raise ValueError(f"{what}: expected a list of [hash, group], got {type(items).__name__}")
    return [BlockKey(bytes.fromhex(str(h)), int(g)) for h, g in items]


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _receive(sock: socket.socket) -> dict[str, object]:
    header = _read_exactly(sock, _HEADER.size)
    (length,) = _HEADER.unpack(header)
    if length > _MAX_MESSAGE:
        raise ValueError(f"stage channel message of {length} bytes (at most {_MAX_MESSAGE})")
    message = json.loads(_read_exactly(sock, length))
    if not isinstance(message, dict):
        raise ValueError("stage channel message is not a JSON object")
    return message


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("stage channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


#: a worker's stage call: chains of keys → per chain (leading blocks staged and pinned, next one lost)
StageFn = Callable[[list[list[BlockKey]]], list[tuple[int, bool]]]
ReleaseFn = Callable[[list[BlockKey]], None]


class StageServer:
    """A worker's end: serves stage and release requests on a Unix socket, one thread per connection.

    ``stage`` runs the reads (verified, into pinned staging); ``release`` drops staged copies the
    manager will not load. A request whose answer cannot be delivered (the manager gave up on it)
    releases what it staged, so no pin outlives a round the manager counted as a miss.
    """

    def __init__(self, path: str, stage: StageFn, release: ReleaseFn) -> None:
        self.path = path
        self._stage, self._release = stage, release
        with contextlib.suppress(FileNotFoundError):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:  # a stale socket of a process that died: ours now
                os.unlink(path)
            else:
                raise OSError(f"another kvtier worker serves {path}")
            finally:
                probe.close()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is this user's only
        try:
            self._sock.bind(path)
        finally:
            os.umask(old_umask)
        self._sock.listen(8)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvtier-stage-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-stage-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                try:
                    request = _receive(conn)
                except (ConnectionError, OSError):
                    return
                except ValueError as exc:
                    log.error("kvtier: bad stage channel request: %s", exc)
                    return
                chains: list[list[BlockKey]] = []
                try:
                    release = _decode(request.get("release", []), "release")
                    if release:
                        self._release(release)
                    raw_chains = request.get("stage", [])
                    chains = [
                        _decode(chain, "stage")
                        for chain in (raw_chains if isinstance(raw_chains, list) else [])
                    ]
                    staged = self._stage(chains) if chains else []
                except Exception:
                    log.exception("kvtier: stage request failed; answering miss")
                    staged = [(0, False)] * len(chains)
                try:
                    _send(conn, {"staged": [[count, lost] for count, lost in staged]})
                except OSError:  # the manager gave up on this round: it will never load these copies
                    self._release(
                        [
                            key
                            for chain, (count, _) in zip(chains, staged, strict=True)
                            for key in chain[:count]
                        ]
                    )
                    return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclass
class StageResult:
    """One chain's outcome over every rank: leading blocks staged on all of them, and whether the next
    one is missing or corrupt on at least one rank (then the manager forgets it)."""

    staged: int
    lost: bool


@dataclass
class _Round:
    chains: list[list[BlockKey]]
    futures: list[concurrent.futures.Future[StageResult]]
    release: list[BlockKey] = field(default_factory=list)


class StageClient:
    """The manager's end: one connection per rank, driven by a thread of its own.

    :meth:`submit` queues a round (one request per rank) and returns one future per chain, resolved
    when every rank answered; a rank that fails to answer within ``timeout`` seconds, or cannot be
    reached, makes every chain of the round a miss (its connection is dropped: a late answer is never
    read as the next one's). Copies staged beyond what every rank staged are released in the next
    round, as are the keys passed to :meth:`release`.
    """

    def __init__(self, paths: Sequence[str], timeout: float = DEFAULT_STAGE_TIMEOUT) -> None:
        if not paths:
            raise ValueError("a stage client needs at least one worker socket")
        self.paths = list(paths)
        self.timeout = timeout
        self._conns: list[socket.socket | None] = [None] * len(self.paths)
        self._queue: queue.SimpleQueue[_Round | None] = queue.SimpleQueue()
        self._release_lock = threading.Lock()
        self._to_release: list[BlockKey] = []
        self.rounds = 0
        self.timeouts = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-stage-client", daemon=True)
        self._thread.start()

    def submit(self, chains: Sequence[Sequence[BlockKey]]) -> list[concurrent.futures.Future[StageResult]]:
        futures: list[concurrent.futures.Future[StageResult]] = [concurrent.futures.Future() for _ in chains]
        if self._closed:
            for future in futures:
                future.set_result(StageResult(0, False))
            return futures
        self._queue.put(_Round([list(chain) for chain in chains], futures))
        return futures

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop these staged copies on every rank with the next round (see :meth:`flush`)."""
        with self._release_lock:
            self._to_release.extend(keys)

    def has_releases(self) -> bool:
        return bool(self._to_release)

    def flush(self) -> None:
        """Send the pending releases now (a round with nothing to stage)."""
        if self._to_release:
            self._queue.put(_Round([], []))

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=self.timeout + 1)
        for conn in self._conns:
            if conn is not None:
                conn.close()

    # --- the client thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            round_ = self._queue.get()
            if round_ is None:
                return
            try:
                self._do_round(round_)
            except Exception:  # never leave a future unresolved: an unresolved one would stall a request
                log.exception("kvtier: stage round failed; its blocks are misses")
                for future in round_.futures:
                    if not future.done():
                        future.set_result(StageResult(0, False))

    def _do_round(self, round_: _Round) -> None:
        with self._release_lock:
            round_.release, self._to_release = self._to_release, []
        request = {"stage": [_encode(chain) for chain in round_.chains], "release": _encode(round_.release)}
        self.rounds += 1
        answers: list[list[tuple[int, bool]] | None] = []
        sent: list[bool] = []
        for r in range(len(self.paths)):  # send to every rank first: they stage in parallel
            sent.append(self._send_to(r, request))
        for r in range(len(self.paths)):
            answers.append(self._answer_of(r, len(round_.chains)) if sent[r] else None)
        per_rank = [a for a in answers if a is not None]
        complete = len(per_rank) == len(self.paths)
        if not complete and round_.release:  # a rank missed the releases: send them again next round
            self.release(round_.release)
        extra: list[BlockKey] = []
        for i, (chain, future) in enumerate(zip(round_.chains, round_.futures, strict=True)):
            if not complete:  # a rank may still stage these late: released everywhere (a no-op where absent)
                extra.extend(chain)
                future.set_result(StageResult(0, False))
                continue
            counts = [a[i][0] for a in per_rank]
            staged = min(counts)
            lost = any(a[i][1] and a[i][0] == staged for a in per_rank)
            if max(counts) > staged:  # staged on some ranks only: never promised, so released
                extra.extend(chain[staged : max(counts)])
            future.set_result(StageResult(staged, lost))
        if extra:
            self.release(extra)

    def _send_to(self, r: int, request: dict[str, object]) -> bool:
        conn = self._conns[r]
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self.timeout)
            try:
                conn.connect(self.paths[r])
            except OSError as exc:
                log.warning(
                    "kvtier: cannot reach the worker of rank %d at %s (%s); its blocks are misses",
                    r,
                    self.paths[r],
                    exc,
                )
                conn.close()
                return False
            self._conns[r] = conn
        try:
            _send(conn, request)
            return True
        except OSError as exc:
            log.warning("kvtier: stage request to rank %d failed (%s); its blocks are misses", r, exc)
            self._drop(r)
            return False

    def _answer_of(self, r: int, chains: int) -> list[tuple[int, bool]] | None:
        conn = self._conns[r]
        assert conn is not None
        try:
            message = _receive(conn)
            staged = message.get("staged")
            if not isinstance(staged, list) or len(staged) != chains:
                raise ValueError(f"answered {staged!r} for {chains} chains")
            return [(int(count), bool(lost)) for count, lost in staged]
        except TimeoutError:
            self.timeouts += 1
            log.warning(
                "kvtier: rank %d did not answer a stage request within %.1f s; its blocks are misses",
                r,
                self.timeout,
            )
        except (OSError, ValueError) as exc:
            log.warning("kvtier: stage answer of rank %d unusable (%s); its blocks are misses", r, exc)
        self._drop(r)
        return None

    def _drop(self, r: int) -> None:
        conn, self._conns[r] = self._conns[r], None
        if conn is not None:
            conn.close()
