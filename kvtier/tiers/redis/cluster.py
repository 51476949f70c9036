"""Where keys live: the Redis Cluster slot map, and SCAN of every primary, through redis-py's sync client.

The data path speaks RESP itself (:mod:`kvtier.tiers.redis.protocol`); everything else that talks to
Redis goes through one library, redis-py, synchronously, on a thread that may block: reading the
slot map (``CLUSTER SLOTS``) and listing keys (``SCAN``). redis-py is imported only here, and only
when used, so ``kvtier.config`` can validate a redis tier without the ``redis`` extra installed.

Routing: a key's hash slot (redis-py's ``key_slot``, CRC16 mod 16384) indexes a table of 16384
primaries. The tier follows ``MOVED`` and ``ASK`` replies itself and asks for a fresh table when
one tells it the map is stale (:meth:`SlotMap.refresh`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import TierUnavailable
from kvtier.tiers.redis.protocol import Addr

#: Hash slots of a Redis Cluster.
SLOTS = 16384


def require_redis_py() -> None:
    """Raise :class:`TierUnavailable` naming the extra to install when redis-py is missing."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise TierUnavailable("the redis tier needs redis-py: pip install 'kvtier[redis]'") from None


@dataclass(frozen=True)
class ClientOptions:
    """What a redis-py client needs to reach any node of this tier."""

    username: str | None
    password: str | None
    db: int
    tls: bool
    tls_ca_file: str | None
    connect_timeout: float
    timeout: float

    def client(self, addr: Addr) -> Any:
        """A synchronous ``redis.Redis`` for one node (close it after use)."""
        import redis

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.tls_ca_file} if self.tls else {}
        return redis.Redis(host=addr.host, port=addr.port, db=self.db, username=self.username,
                           password=self.password, socket_connect_timeout=self.connect_timeout,
                           socket_timeout=self.timeout, decode_responses=False, **tls)


class SlotMap:
    """Which primary serves each hash slot, read with ``CLUSTER SLOTS`` from any node that answers.

    Lookups (:meth:`node_for`) run on the event loop and never block; :meth:`refresh` blocks and
    runs on a worker thread. A refresh swaps in a whole new table, so a lookup sees the old or the
    new one, never a mix.
    """

    def __init__(self, startup_nodes: Sequence[Addr], options: ClientOptions) -> None:
        from redis.crc import key_slot

        self._key_slot: Callable[[bytes], int] = key_slot
        self._startup = list(startup_nodes)
        self._options = options
        self._owner: list[Addr | None] | None = None
        self._lock = threading.Lock()
        #: ``time.monotonic()`` of the last successful read (``-inf`` before the first).
        self.read_at = float("-inf")

    @property
    def known(self) -> bool:
        """Whether a table was read at least once."""
        return self._owner is not None

    def node_for(self, rkey: bytes) -> Addr | None:
        """The primary serving ``rkey``'s slot, or None when no node covers it (or nothing was read yet)."""
        owner = self._owner
        return owner[self._key_slot(rkey)] if owner is not None else None

    def primaries(self) -> list[Addr]:
        """Every primary that serves at least one slot, in address order."""
        owner = self._owner or []
        return sorted({addr for addr in owner if addr is not None})

    def refresh(self, older_than: float) -> None:
        """Blocking: read the table unless a read finished after ``older_than`` (another thread did it).

        Asks the primaries of the current table first, then the startup nodes; raises
        ``ConnectionError`` naming every node tried when none answers.
        """
        with self._lock:
            if self.read_at > older_than:
                return
            errors = []
            for addr in dict.fromkeys([*self.primaries(), *self._startup]):
                try:
                    rows = self._cluster_slots(addr)
                except Exception as exc:  # redis.RedisError, OSError: try the next node
                    errors.append(f"{addr}: {exc}")
                    continue
                self._owner = _table(rows, addr)
                self.read_at = time.monotonic()
                return
            raise ConnectionError("no node answered CLUSTER SLOTS (" + "; ".join(errors) + ")")

    def _cluster_slots(self, addr: Addr) -> Any:
        client = self._options.client(addr)
        try:
            return client.execute_command("CLUSTER SLOTS")
        finally:
            client.close()


def _table(rows: Any, asked: Addr) -> list[Addr | None]:
    """``CLUSTER SLOTS`` rows ``[start, end, [host, port, id…], replicas…]`` → slot → primary."""
    owner: list[Addr | None] = [None] * SLOTS
    for row in rows:
        start, end, primary = int(row[0]), int(row[1]), row[2]
        host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        if host == "?":  # the node does not know its peer's address yet: leave the slots uncovered
            continue
        addr = Addr(host or asked.host, int(primary[1]))  # "" means: the node that answered
        owner[start:end + 1] = [addr] * (end - start + 1)
    return owner


def scan_keys(nodes: Sequence[Addr], options: ClientOptions, pattern: bytes,
              on_error: Callable[[Addr, Exception], None]) -> Iterator[bytes]:
    """``SCAN MATCH pattern`` on each node in turn; a node that fails is reported and skipped."""
    for addr in nodes:
        client = options.client(addr)
        try:
            yield from client.scan_iter(match=pattern, count=1000)
        except Exception as exc:  # redis.RedisError, OSError
            on_error(addr, exc)
        finally:
            client.close()
