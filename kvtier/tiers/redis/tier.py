"""The Redis tier: KV blocks as values in one Redis server or a Redis Cluster, shared by processes.

One value per block (codec header ‖ payload) under ``kvtier:<namespace>:<group>:<hash hex>``; Redis
owns capacity, so a key it dropped is a miss. This module routes a batch to nodes, follows
``MOVED``/``ASK`` once, and keeps the per-node breakers, counters and health; the wire protocol and
pools are in ``protocol``, the per-block requests and I/O threads in ``requests``, the slot map and
SCAN in ``cluster``. Faults become misses or ``False``, never exceptions. docs/redis.md has the rest.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal
from urllib.parse import unquote, urlsplit

import numpy as np
import torch

from kvtier.blocks import BlockKey
from kvtier.codec import MAX_HASH_BYTES, RawHeaders
from kvtier.errors import LayoutMismatch
from kvtier.hashing import namespace_fingerprint
from kvtier.layout import BlockLayout
from kvtier.logs import LogLimiter
from kvtier.tiers.base import Tier
from kvtier.tiers.redis.breaker import CircuitBreaker, CircuitBreakerConfig
from kvtier.tiers.redis.cluster import ClientOptions, SlotMap, require_redis_py, scan_keys
from kvtier.tiers.redis.protocol import Addr, Connector, Pool, native_refusal
from kvtier.tiers.redis.requests import ExistsOp, GetOp, NodeRun, Op, SetOp, UnlinkOp, run_stream

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
#: A stale cluster slot map is re-read at most this often.
_TOPOLOGY_REFRESH_SECONDS = 1.0
_FORBIDDEN_IN_NAMESPACE = set(" \t\r\n\0{}*?[]\\")


class RedisTier(Tier):
    """Blocks as Redis values, on one server (``url``) or a Redis Cluster (``cluster``/``startup_nodes``).

    The keyword arguments are the keys of a ``type: redis`` tier, already validated by
    ``kvtier.config.RedisTierConfig`` (the README's configuration table documents them); the tier
    only derives what it needs from them. ``namespace`` is the cache's model/layout fingerprint, part
    of every key. Construction opens nothing: connections are made on first use.
    ``capacity_bytes`` is informational: the server's ``maxmemory`` decides what stays.
    """

    kind = "redis"
    self_evicting = True

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout],
                 capacity_bytes: Mapping[int, int] | None = None,
                 *, namespace: str, url: str | None = None, cluster: bool = False,
                 startup_nodes: Sequence[str] | None = None, username: str | None = None,
                 password: str | None = None, tls_ca_file: str | None = None,
                 ttl_seconds: float | None = None,
                 compression: Compression = "none", connect_timeout: float = 1.0, timeout: float = 2.0,
                 max_connections: int = 16, circuit_breaker: CircuitBreakerConfig | None = None,
                 namespace_fp: int | None = None) -> None:
        super().__init__(name, layouts,
                         capacity_bytes if capacity_bytes is not None else dict.fromkeys(layouts, 0))
        if not namespace or set(namespace) & _FORBIDDEN_IN_NAMESPACE or not namespace.isprintable():
            raise ValueError(f"namespace {namespace!r} must be non-empty printable text without whitespace, "
                             f"braces (cluster hash tags) or glob characters")
        require_redis_py()
        self.namespace = namespace
        #: written into every value's header and checked on every read (another namespace's value is corrupt)
        self.namespace_fp = namespace_fingerprint(namespace) if namespace_fp is None else namespace_fp
        self._corrupt_log = LogLimiter(log, f"invalid values dropped by redis tier {name!r}")
        self.compression: Compression = compression
        self.ttl_seconds = ttl_seconds
        self.connect_timeout = float(connect_timeout)
        self.timeout = float(timeout)
        self.max_connections = max_connections
        self.breaker_config = circuit_breaker if circuit_breaker is not None else CircuitBreakerConfig()

        parsed = urlsplit(url or DEFAULT_URL)
        port = parsed.port or 6379
        self.db = int(parsed.path.strip("/") or 0)
        self.username = username if username is not None else (
            unquote(parsed.username) if parsed.username else None)
        self.password = password if password is not None else (
            unquote(parsed.password) if parsed.password else None)
        self.tls = parsed.scheme == "rediss" or tls_ca_file is not None
        self.tls_ca_file = tls_ca_file
        self.cluster = bool(cluster or startup_nodes)
        self.address: Addr | None = None if self.cluster else Addr(parsed.hostname or "127.0.0.1", port)
        self.startup_nodes: list[Addr] = []
        if self.cluster:
            for i, node in enumerate(startup_nodes or [f"{parsed.hostname or '127.0.0.1'}:{port}"]):
                addr = Addr.parse(node)
                if addr is None:
                    raise ValueError(f"startup_nodes[{i}] must be host:port, got {node!r}")
                self.startup_nodes.append(addr)

        self._key_prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self._fingerprints = {gid: layout.fingerprint() for gid, layout in self.layouts.items()}
        self._itemsizes = {gid: layout.itemsize for gid, layout in self.layouts.items()}
        self._raw_headers = {gid: RawHeaders(self._fingerprints[gid], layout.nbytes, self.namespace_fp)
                             for gid, layout in self.layouts.items()}
        self._ttl_args = b"" if ttl_seconds is None else _ttl_args(ttl_seconds)
        ssl_context = ssl.create_default_context(cafile=tls_ca_file) if self.tls else None
        self._connector = Connector(self.username, self.password, self.db, ssl_context, self.connect_timeout,
                                    self.timeout)
        self._client_options = ClientOptions(self.username, self.password, self.db, self.tls, tls_ca_file,
                                             self.connect_timeout, self.timeout)
        self._slot_map = SlotMap(self.startup_nodes, self._client_options) if self.cluster else None
        self._pools: dict[Addr, Pool] = {}
        self._breakers: dict[Addr | str, CircuitBreaker] = {}
        self._open_nodes: set[object] = set()
        #: I/O streams each node's batches run on now (event loop thread only)
        self._busy_streams: dict[Addr, int] = {}
        self._executor: ThreadPoolExecutor | None = None
        #: raw GETs and SETs through kvtier/kernels/redisio.c (decided on first use; docs/redis.md)
        self._native: bool | None = None
        self._topology_stale = True
        self._topology_tried_at = float("-inf")

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
        ops = [SetOp(i, key, self.redis_key(key), arrays[i], self._fingerprints[key.group_id],
                     self._itemsizes[key.group_id], compress, self._ttl_args, self.namespace_fp,
                     self._raw_headers[key.group_id])
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
        ops = [GetOp(i, key, self.redis_key(key), arrays[i], self._fingerprints[key.group_id],
                     self._itemsizes[key.group_id], self.namespace_fp, self._raw_headers[key.group_id])
               for i, key in enumerate(keys)]
        await self._execute(ops)
        for op in ops:
            if op.ok:
                self.counters.blocks_read += 1
                self.counters.bytes_read += op.value_bytes
        self.counters.read_seconds += time.perf_counter() - start
        corrupt = [op for op in ops if op.error == "corrupt"]
        for op in corrupt:
            self._corrupt_log.log("redis tier %r: dropping invalid value of %s: %s",
                                  self.name, op.key, op.why)
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
        ops = [ExistsOp(i, key, self.redis_key(key)) for i, key in enumerate(keys)]
        await self._execute(ops)
        return [op.ok for op in ops]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """UNLINK the keys (the server frees memory in the background); failures are counted only."""
        unique = list(dict.fromkeys(keys))
        if unique:
            await self._execute([UnlinkOp(i, key, self.redis_key(key)) for i, key in enumerate(unique)])

    def keys(self) -> Iterator[BlockKey]:
        """SCAN every primary for this namespace's keys with redis-py's synchronous client.

        For tools and start-up, not for the event loop's hot path: it blocks the calling thread for
        the whole scan. An unreachable node is counted (``connection``) and skipped.
        """
        return iter(list(self._scan_keys()))

    def usage_bytes(self) -> int:
        """0: Redis owns capacity (``INFO memory``, ``maxmemory``); kvtier does not track it."""
        return 0

    async def close(self) -> None:
        """Close idle connections and the I/O threads; a later call reconnects."""
        for pool in self._pools.values():
            pool.drop_idle()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, True)
        for pool in self._pools.values():  # connections returned by streams that were finishing
            pool.drop_idle()
        self._corrupt_log.flush()

    # --- execution -----------------------------------------------------------------------------------------
    def _host_array(self, block: torch.Tensor, what: str) -> np.ndarray:
        if block.device.type != "cpu":
            raise LayoutMismatch(
                f"{what} for redis tier {self.name!r} must be in host memory, got {block.device}")
        return block.numpy()

    def _io_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            threads = min(64, self.max_connections * max(1, len(self.startup_nodes)))
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-redis-{self.name}")
        return self._executor

    def after_fork_in_child(self) -> None:
        """The parent's I/O threads are not in the child, and its pooled connections must not be shared
        (two processes' requests on one socket would take each other's replies): the child closes its
        copies of all of them, idle or busy at the fork (the parent's stay open), and connects afresh;
        breakers are kept."""
        super().after_fork_in_child()
        for pool in self._pools.values():
            pool.forget_after_fork()
        self._pools = {}
        self._executor = None
        self._busy_streams = {}

    def _native_io(self) -> bool:
        """Whether raw GETs and SETs go through the native helper: built (``KVTIER_NATIVE`` not 0), no
        compression (lz4 values are encoded here) and no TLS (the helper speaks to a plain socket)."""
        if self._native is None:
            self._native = native_refusal(self.compression, self.tls) is None
        return self._native

    def _pool(self, addr: Addr) -> Pool:
        pool = self._pools.get(addr)
        if pool is None:
            pool = self._pools[addr] = Pool(addr, self.max_connections, self._connector.connect)
        return pool

    def _breaker(self, target: Addr | str) -> CircuitBreaker:
        breaker = self._breakers.get(target)
        if breaker is None:
            breaker = self._breakers[target] = CircuitBreaker(self.breaker_config)
        return breaker

    async def _execute(self, ops: Sequence[Op]) -> None:
        """Run ops on their nodes concurrently, follow one MOVED or ASK per op, then count the ops' errors.

        ``MOVED``: the slot has a new owner; the op is retried there and the slot map re-read soon.
        ``ASK``: the slot is migrating and this key is already at the target; the op is retried
        there behind ``ASKING``, and the slot map stays as it is (the source still owns the slot).
        """
        by_node = await self._route(ops)
        await asyncio.gather(*(self._run_node(addr, node_ops) for addr, node_ops in by_node.items()))
        redirected = [op for op in ops if op.redirect is not None and not op.retried]
        if redirected:
            again: dict[Addr, list[Op]] = {}
            for op in redirected:
                assert op.error is not None and op.redirect is not None
                self.counters.error(op.error)
                if op.error == "moved":
                    self._topology_stale = True
                again.setdefault(op.redirect, []).append(op)
                op.asking = op.error == "ask"
                op.retried = True
                op.reset()
            await asyncio.gather(*(self._run_node(addr, node_ops) for addr, node_ops in again.items()))
        for op in ops:
            if op.error is not None:
                self.counters.error(op.error)
                if op.error in ("clusterdown", "readonly", "moved"):
                    self._topology_stale = True

    async def _run_node(self, addr: Addr, ops: list[Op]) -> None:
        """One node's share of a batch on up to ``_STREAMS_PER_NODE`` I/O threads; updates its breaker."""
        breaker = self._breaker(addr)
        if not breaker.allow():
            self.counters.error("circuit_open", len(ops))
            return
        large = ops[0].large
        # a node's connections serve every batch in flight: a batch takes the streams still free (at
        # least one), as more streams per batch than connections would only add hand-offs (docs/redis.md)
        busy = self._busy_streams.get(addr, 0)
        streams = max(1, min(len(ops), _STREAMS_PER_NODE, self.max_connections - busy)) if large else 1
        run = NodeRun(ops, native=large and self._native_io(), streams=streams)
        depth = _PIPELINE_DEPTH if large else _SMALL_DEPTH
        pool = self._pool(addr)
        loop = asyncio.get_running_loop()
        executor = self._io_executor()
        self._busy_streams[addr] = busy + streams
        try:
            futures = [loop.run_in_executor(executor, run_stream, pool, run, depth, i == 0, self.timeout)
                       for i in range(streams)]
            try:
                outcomes = await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))
            except asyncio.CancelledError:
                run.cancel()  # the threads stop after the requests they sent …
                await asyncio.wait(futures)  # … and nothing touches the caller's buffers after we return
                raise
            for outcome in outcomes:  # only a bug gets here: I/O faults were turned into errors already
                if isinstance(outcome, BaseException):
                    raise outcome
        finally:
            self._busy_streams[addr] -= streams
            for kind in run.errors:
                self.counters.error(kind)
            if run.failed:
                self._topology_stale = True
                if breaker.failure():
                    self._open_nodes.add(addr)
                    self.report_health(
                        False,
                        f"circuit open for {', '.join(sorted(map(str, self._open_nodes)))} "
                        f"({run.detail}); probing every {self.breaker_config.cooldown_seconds:g} s")
            elif run.succeeded and breaker.success():
                self._open_nodes.discard(addr)
                self.report_health(not self._open_nodes,
                                   f"circuit open for {', '.join(sorted(map(str, self._open_nodes)))}")
            breaker.end_attempt()

    # --- cluster routing ---------------------------------------------------------------------------------
    async def _route(self, ops: Sequence[Op]) -> dict[Addr, list[Op]]:
        if self._slot_map is None:
            assert self.address is not None
            return {self.address: list(ops)}
        slot_map = await self._fresh_slot_map()
        by_node: dict[Addr, list[Op]] = {}
        uncovered = 0
        for op in ops:
            node = slot_map.node_for(op.rkey)
            if node is None:  # no slot map yet, or part of the cluster is unknown right now
                uncovered += 1
                continue
            by_node.setdefault(node, []).append(op)
        if uncovered:
            unreadable = not slot_map.known and self._breaker("topology").is_open
            self.counters.error("circuit_open" if unreadable else "topology", uncovered)
            self._topology_stale = True
        return by_node

    async def _fresh_slot_map(self) -> SlotMap:
        """The slot map, re-read first (on a worker thread, rate-limited) when it is stale."""
        slot_map = self._slot_map
        assert slot_map is not None
        now = time.monotonic()
        if not self._topology_stale or (slot_map.known
                                        and now - self._topology_tried_at < _TOPOLOGY_REFRESH_SECONDS):
            return slot_map
        breaker = self._breaker("topology")
        if not breaker.allow():
            return slot_map
        self._topology_tried_at = now
        budget = self.connect_timeout * (len(self.startup_nodes) + 1) + self.timeout
        try:
            await asyncio.wait_for(asyncio.to_thread(slot_map.refresh, now), budget)
        except Exception as exc:  # ConnectionError from refresh, TimeoutError from wait_for
            self.counters.error("topology")
            if breaker.failure():
                log.warning("redis tier %r: cannot read the cluster slot map from %s (%s); "
                            "retrying in %.1f s",
                            self.name, [str(a) for a in self.startup_nodes], exc,
                            self.breaker_config.cooldown_seconds)
        else:
            self._topology_stale = False
            breaker.success()
        finally:
            breaker.end_attempt()
        return slot_map

    def _scan_keys(self) -> Iterator[BlockKey]:
        def failed(addr: Addr, exc: Exception) -> None:
            self.counters.error("connection")
            log.warning("redis tier %r: listing keys failed on %s: %s", self.name, addr, exc)

        if self._slot_map is None:
            assert self.address is not None
            nodes = [self.address]
        else:
            try:
                self._slot_map.refresh(time.monotonic())
            except ConnectionError as exc:
                failed(self.startup_nodes[0], exc)
            nodes = self._slot_map.primaries()
        for rkey in scan_keys(nodes, self._client_options, self._key_prefix + b"*", failed):
            key = self._parse_redis_key(rkey)
            if key is not None:
                yield key

    def _parse_redis_key(self, rkey: bytes) -> BlockKey | None:
        group, sep, hex_hash = rkey[len(self._key_prefix):].partition(b":")
        try:
            return BlockKey(bytes.fromhex(hex_hash.decode()), int(group)) if sep else None
        except ValueError:
            return None


def _ttl_args(ttl_seconds: float) -> bytes:
    """``PX <milliseconds>`` (at least 1 ms): a TTL may be a fraction of a second."""
    millis = str(max(1, round(ttl_seconds * 1000))).encode()
    return b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(millis), millis)


__all__ = ["Compression", "DEFAULT_URL", "KEY_PREFIX", "RedisTier"]
