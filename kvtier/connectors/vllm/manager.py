"""The scheduler side: vLLM's ``OffloadingManager`` calls over an :class:`OffloadRuntime`.

Independent of vLLM's classes (``kvtier.connectors.vllm.spec`` subclasses it as vLLM's manager), so
the main suite drives it with a harness.

One module (over 500 lines) because every call reads and changes the same per-engine state on
vLLM's scheduler thread: the loadable map, the stores in flight, the plans to settle and the slow-tier
blocks being staged; the stage channel's wire side is :mod:`.stage_channel`, the index
:mod:`.scheduler_index`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvtier.blocks import BlockKey
from kvtier.connectors.vllm.geometry import Lookup
from kvtier.connectors.vllm.runtime import LOST, STAGED, OffloadRuntime
from kvtier.connectors.vllm.single_tier_lru import SingleTierLRU
from kvtier.connectors.vllm.stage_channel import StageClient, StageResult
from kvtier.metrics import CacheStats
from kvtier.policy.base import InsertHint
from kvtier.residency import Plan


@dataclass(frozen=True)
class BlockTransferSpec:
    """What the manager tells the worker: the blocks to move; for loads, where each one is pinned; for
    stores, the manager's :class:`~kvtier.residency.Plan` (writes per tier, demotions, drops) over
    ``keys``."""

    keys: tuple[BlockKey, ...]
    sources: tuple[int, ...] = ()
    plan: Plan | None = None
    #: the manager's index is in another process than the worker's tiers: loads are released and stores
    #: settled by the manager (the worker only moves bytes)
    placed: bool = False
    #: for stores: vLLM's offload key of each of ``keys`` (in order), which the manager has at hand: the
    #: worker's runtime mirrors the stored blocks under them without deriving them again
    offload_keys: tuple[bytes, ...] = ()


@dataclass
class ManagerCounters:
    fetches: int = 0
    fetched_blocks: int = 0
    leases: int = 0
    lost_blocks: int = 0
    stores_prepared: int = 0


@dataclass
class _Fetch:
    pending_hit: bool  # True: an indexed tier holds it (HIT_PENDING); False: a remote probe (RETRY)
    position: int  # in its chain: the read staged this key if it staged more than ``position`` keys
    #: its read: an int (blocks staged here), or the stage channel's StageResult over every rank
    future: concurrent.futures.Future[Any] | None = None

    def staged_it(self) -> bool:
        """Whether the finished read staged this key (a failed read did not)."""
        assert self.future is not None
        return self.future.exception() is None and _staged_count(self.future.result()) > self.position

    def lost_it(self) -> bool:
        """Whether a rank found this key missing or corrupt (the stage channel's answer)."""
        assert self.future is not None
        result = self.future.result() if self.future.exception() is None else None
        return isinstance(result, StageResult) and result.lost and result.staged == self.position


def _staged_count(result: int | StageResult) -> int:
    return result.staged if isinstance(result, StageResult) else result


@dataclass
class _Promise:
    """A slow-tier block every rank staged and pinned: a HIT until loaded (or unused for a while)."""

    block_key: BlockKey
    since: float
    leases: int = 0


#: seconds a promise that no load took stays staged on the ranks
PROMISE_TTL = 30.0


def _written(plan: Plan) -> list[int]:
    """Indexes of the keys a plan writes anywhere, ascending (a plan's writes of one tier already are)."""
    filled = [writes for writes in plan.writes if writes]
    if len(filled) == 1:
        return filled[0]
    return sorted({i for writes in filled for i in writes})


class KVTierOffloadManager:
    """vLLM's scheduler-side calls over an :class:`OffloadRuntime` (independent of vLLM's classes).

    Called on the scheduler thread only. ``lookup`` never blocks; ``prepare_load`` takes the cache's
    index lock once (the pins), and hops to kvtier's loop thread only for a block that left memory
    since its lookup; everything else is bookkeeping. Events (``enable_events``) are vLLM's
    ``(offload keys, removed)`` pairs in the order they happened.
    """

    def __init__(self, runtime: OffloadRuntime, *, results: Mapping[Lookup, Any] | None = None,
                 spec_type: Callable[..., BlockTransferSpec] = BlockTransferSpec, absent_ttl: float = 1.0,
                 enable_events: bool = False, stage: StageClient | None = None) -> None:
        answer = dict(results) if results is not None else {r: r for r in Lookup}
        self._hit, self._miss = answer[Lookup.HIT], answer[Lookup.MISS]
        self._pending, self._retry = answer[Lookup.HIT_PENDING], answer[Lookup.RETRY]
        self.runtime = runtime
        self._codec = runtime.codec
        self._residency = runtime.residency
        self._core = runtime.core
        self._memory_tiers = runtime.memory_tiers
        self._loadable = runtime.mirror.loadable
        self._has_memory = bool(runtime.memory_tiers)
        self._staging = runtime.staging
        self._spec_type = spec_type
        self._absent_ttl = absent_ttl
        self._storing: dict[bytes, int] = {}
        self._fetching: dict[bytes, _Fetch] = {}
        self._fetch_queue: dict[tuple[str, int], list[tuple[bytes, BlockKey]]] = {}
        self._absent: dict[bytes, float] = {}
        self._used: dict[str, list[BlockKey]] = {}  # per request: blocks it loaded or offered, in order
        # with the workers in other processes (runtime.index_only): plans to settle at complete_store,
        # pins to drop at complete_load, and blocks a reset dropped that the workers must delete
        self._placed = runtime.index_only
        #: per offload key being stored: its plan, the plan's block keys and their offload keys
        self._plans: dict[bytes, tuple[Plan, tuple[BlockKey, ...], list[bytes]]] = {}
        self._loading: dict[bytes, list[tuple[BlockKey, int]]] = {}
        self._reset_drops: list[BlockKey] = []
        # slow tiers with the workers in other processes: blocks every rank staged (stage channel)
        self._stage = stage
        self._promised: dict[bytes, _Promise] = {}
        self._lost_drops: list[tuple[int, BlockKey]] = []  # forgotten slow-tier blocks the workers delete
        self._next_expiry = 0.0
        self._events: list[tuple[list[bytes], bool]] | None = [] if enable_events else None
        self.counters = ManagerCounters()
        #: one memory tier with LRU (the usual setup): plans, settles and touches batched
        self._fast = SingleTierLRU.of(runtime) if stage is None else None

    # --- lookups ------------------------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        """Whether one chunk can be loaded now (HIT), soon (HIT_PENDING / RETRY), or not (MISS)."""
        if key in self._loadable:
            return self._hit
        return self._lookup_slow(key, req_context)

    def _lookup_slow(self, key: bytes, req_context: Any) -> Any:
        if self._promised:
            promise = self._promised.get(key)
            if promise is not None:
                promise.since = time.monotonic()
                return self._hit
        block_key = self._codec.block_key(key)
        fetch = self._fetching.get(key)
        if fetch is not None:
            if fetch.future is None or not fetch.future.done():
                return self._hit if block_key in self._staging else (
                    self._pending if fetch.pending_hit else self._retry)
            if self._settle_fetch(key, block_key):
                return self._hit
            # the read failed (absent below), or its copy was loaded since: look again
        if block_key in self._staging:
            return self._hit
        if key in self._storing:
            return self._pending
        expiry = self._absent.get(key)
        if expiry is not None:
            if expiry > time.monotonic():
                return self._miss
            del self._absent[key]
        if self._residency.locate(block_key) is not None:
            self._queue_fetch(key, block_key, req_context, pending_hit=True)
            return self._pending
        if self.runtime.has_remote or self._stage is not None:  # ranks may hold blocks this index never saw
            self._queue_fetch(key, block_key, req_context, pending_hit=False)
            return self._retry
        return self._miss

    def _queue_fetch(self, key: bytes, block_key: BlockKey, req_context: Any, *, pending_hit: bool) -> None:
        req_id = str(getattr(req_context, "req_id", ""))
        chain = self._fetch_queue.setdefault((req_id, block_key.group_id), [])
        self._fetching[key] = _Fetch(pending_hit, position=len(chain))
        chain.append((key, block_key))

    def _settle_fetch(self, key: bytes, block_key: BlockKey) -> bool:
        """Forget a finished read; whether the block is loadable now.

        A block the read could not stage (missing, corrupt, a tier down) is absent for a while: not
        asked for again at every lookup. One it staged that a load has consumed since is not: the
        next lookup reads it again.
        """
        fetch = self._fetching.pop(key)
        if self._stage is not None:
            return self._settle_stage(key, block_key, fetch)
        if key in self._loadable or block_key in self._staging:
            return True
        if not fetch.staged_it():
            self._absent[key] = time.monotonic() + self._absent_ttl
        return False

    def on_schedule_end(self, context: Any = None) -> None:
        """Start the reads that this step's lookups asked for: one verified chain read per request and group.

        Reads that finished and were not looked at again are settled here, so no state goes stale.
        While reads are in flight the engine thread yields the GIL once per step: vLLM's engine loop
        steps without waiting for them, and with the default 5 ms switch interval kvtier's reader
        threads would otherwise get the GIL a few times per request (file-tier TTFT 141.5 ms → 6.3 ms
        on the tiny-model benchmark, benchmarks/results/vllm_cpu.txt).
        """
        for key, fetch in list(self._fetching.items()):
            if fetch.future is not None and fetch.future.done():
                self._settle_fetch(key, self._codec.block_key(key))
        if self._stage is not None:
            self._stage_round()
        for chain in self._fetch_queue.values():
            future = self.runtime.submit(self.runtime.fetch([block_key for _, block_key in chain]))
            self.counters.fetches += 1
            self.counters.fetched_blocks += len(chain)
            for key, _ in chain:
                queued = self._fetching.get(key)
                if queued is not None:
                    queued.future = future
        self._fetch_queue.clear()
        if self._fetching:
            time.sleep(0)  # hand the GIL to kvtier's I/O threads; returns at once when nothing else runs
        if len(self._absent) > 65536:
            now = time.monotonic()
            self._absent = {k: t for k, t in self._absent.items() if t > now}

    def has_pending_work(self) -> bool:
        """True while reads started by lookups are in flight (the engine must keep stepping)."""
        return any(fetch.future is None or not fetch.future.done() for fetch in self._fetching.values())

    # --- loads --------------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes], req_context: Any = None) -> BlockTransferSpec:
        """Pin the blocks of ``keys`` (all answered HIT) until the worker has read them."""
        loadable, block_key = self._loadable, self._codec.block_key
        block_keys = tuple([loadable.get(k) or block_key(k) for k in keys])
        self._record_use(req_context, block_keys)
        self.counters.leases += 1
        if self._placed:
            pinned = self._core.lease(block_keys, self._memory_tiers)
            sources = tuple(LOST if t is None else t for t in pinned) if not self._promised else \
                self._lease_promised(keys, pinned)
            for key, pinned_key, source in zip(keys, block_keys, sources, strict=True):
                if source != LOST:
                    self._loading.setdefault(key, []).append((pinned_key, source))
        else:
            sources = self.runtime.lease(block_keys)
        if LOST in sources:
            self.counters.lost_blocks += sources.count(LOST)
        return self._spec_type(keys=block_keys, sources=sources, placed=self._placed)

    def complete_load(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        """The workers finished a load: drop its pins (a worker in this process already did, in its read)."""
        if not self._placed:
            return
        released: list[tuple[BlockKey, int]] = []
        for key in keys:
            held = self._loading.get(key)
            if held:
                released.append(held.pop())
                if not held:
                    del self._loading[key]
        if self._promised and any(source == STAGED for _, source in released):
            released = self._release_promised(keys, released)
        if released:
            self._core.release([k for k, _ in released], [t for _, t in released])

    def touch(self, keys: Sequence[bytes], req_context: Any = None) -> None:
        """Mark the blocks recently used where they are, the first one most recently (as vLLM's LRU does)."""
        loadable, block_key = self._loadable, self._codec.block_key
        block_keys = [loadable.get(k) or block_key(k) for k in reversed(keys)]
        if self._fast is not None:
            self._fast.touch(block_keys)
        else:
            self._core.touch(block_keys)

    # --- requests -----------------------------------------------------------------------------------
    def on_request_finished(self, req_context: Any = None) -> None:
        """A request is done: every block it loaded or offered to store counts as used now, its first
        block most recently — the request-scoped recency of vLLM's own LRU policy."""
        used = self._used.pop(str(getattr(req_context, "req_id", "")), None)
        if used:
            used.reverse()
            if self._fast is not None:
                self._fast.touch(used)
            else:
                self._core.touch(used)

    def _record_use(self, req_context: Any, block_keys: Sequence[BlockKey]) -> None:
        req_id = str(getattr(req_context, "req_id", ""))
        used = self._used.get(req_id)
        if used is None:
            self._used[req_id] = list(block_keys)
        else:
            used.extend(block_keys)

    # --- stores -------------------------------------------------------------------------------------
    def plan_store(self, keys: Sequence[bytes],
                   req_context: Any = None) -> tuple[list[bytes], BlockTransferSpec] | None:
        """Decide now where the chunks go, and what that evicts; the worker then only moves bytes.

        Returns the chunks to store (those no memory tier holds and not already being stored, that a
        tier has room for) and their spec, which carries kvtier's plan. None when none of the asked
        chunks can be stored (every tier full of pinned blocks, or refused by admission): vLLM then
        tries again later. Blocks this plan evicts from every tier are reported by the next
        :meth:`take_removed` — vLLM's ``prepare_store`` reports them in its own output.
        """
        if self._fast is not None and keys and self._loadable.keys().isdisjoint(keys) and not (
                self._promised or self._absent or self._fetching or self._reset_drops or self._lost_drops
                or len(self._staging)):
            planned = self._plan_store_fast(keys, req_context)
            if planned is not None:
                return planned
        chosen: list[bytes] = []
        block_keys: list[BlockKey] = []
        predecessors: list[BlockKey | None] = []
        present: list[BlockKey] = []
        # The asked keys are one request's chunks in chain order per group (vLLM stores a prefix in
        # order): each chunk's predecessor is the chunk before it of the same group in this call (the
        # first one's is not known here). Eviction uses the links to drop a chain's tail before its head.
        last_of_group: dict[int, BlockKey] = {}
        loadable, storing, block_key_of = self._loadable, self._storing, self._codec.block_key
        # () answers `in` at C speed; Staging's __contains__ is a Python call per key
        staged: Container[BlockKey] = self._staging if len(self._staging) else ()
        for key in keys:
            held = loadable.get(key)
            if held is not None:
                present.append(held)
                last_of_group[held.group_id] = held
                continue
            block_key = block_key_of(key)
            previous = last_of_group.get(block_key.group_id)
            last_of_group[block_key.group_id] = block_key
            if key in storing or block_key in staged or (self._promised and key in self._promised):
                continue
            chosen.append(key)
            block_keys.append(block_key)
            predecessors.append(previous)
        if present:
            self._record_use(req_context, present)
        if not chosen:
            return [], self._spec_type(keys=())
        # the asked chunks already stored stay: pinned while the plan makes room, never its victims
        pinned = self._core.lease(present, self._memory_tiers) if present else None
        new_hint = tuple.__new__  # InsertHint(...) without its Python-level __new__ (one per stored block)
        try:
            plan = self._core.plan_store(block_keys, [new_hint(InsertHint, (i, -1, previous))
                                                      for i, previous in enumerate(predecessors)])
        finally:
            if pinned is not None:
                self._core.release(present, pinned)
        written = _written(plan)
        if not written:
            return None if not plan.skipped else ([], self._spec_type(keys=()))
        if len(written) < len(chosen):  # the spec names only the chunks stored: renumber the plan's writes
            position = {i: j for j, i in enumerate(written)}
            plan.writes = [[position[i] for i in writes] for writes in plan.writes]
            chosen = [chosen[i] for i in written]
            block_keys = [block_keys[i] for i in written]
        plan.skipped = []
        self._record_use(req_context, block_keys)
        if self._placed:
            if self._reset_drops:  # the workers delete what a reset dropped, in order with the stores
                plan.drops[0].extend(self._reset_drops)
                self._reset_drops = []
            if self._lost_drops:  # slow-tier blocks one rank lost: the others delete their copies
                for t, lost in self._lost_drops:
                    plan.drops[t].append(lost)
                self._lost_drops = []
            self._plans.update(dict.fromkeys(chosen, (plan, tuple(block_keys), chosen)))
        if storing:
            for key in chosen:
                storing[key] = storing.get(key, 0) + 1
        else:  # nothing in flight (vLLM completes each store before the next step plans): all new
            storing.update(dict.fromkeys(chosen, 1))
        if self._absent or self._fetching:
            dropped = []
            for key in chosen:
                self._absent.pop(key, None)
                fetch = self._fetching.pop(key, None)
                if fetch is not None and self._stage is not None:
                    dropped.append((key, fetch))
            if dropped:  # stored now: what the ranks stage for it is released, never promised
                self._release_when_staged(dropped)
        self.counters.stores_prepared += len(chosen)
        return chosen, self._spec_type(keys=tuple(block_keys), plan=plan, placed=self._placed,
                                       offload_keys=tuple(chosen))

    def _plan_store_fast(self, keys: Sequence[bytes],
                         req_context: Any) -> tuple[list[bytes], BlockTransferSpec] | None:
        """:meth:`plan_store` of keys none of which a memory tier holds, through :class:`SingleTierLRU`;
        None when the general path must plan them."""
        storing = self._storing
        chosen = [key for key in keys if key not in storing] if storing else list(keys)
        if not chosen:
            return [], self._spec_type(keys=())
        assert self._fast is not None
        planned = self._fast.plan(chosen)
        if planned is None:
            return None
        block_keys, plan = planned
        self._record_use(req_context, block_keys)
        spec_keys = tuple(block_keys)
        if self._placed:
            self._plans.update(dict.fromkeys(chosen, (plan, spec_keys, chosen)))
        storing.update(dict.fromkeys(chosen, 1))  # none was being stored
        self.counters.stores_prepared += len(chosen)
        return chosen, self._spec_type(keys=spec_keys, plan=plan, placed=self._placed,
                                       offload_keys=tuple(chosen))

    def complete_store(self, keys: Sequence[bytes], req_context: Any = None, success: bool = True) -> None:
        """The workers finished a store job: the blocks are cached, or were refused (a later miss)."""
        if self._placed:  # the workers ran the plan on their tiers: its writes are readable now
            entries = list(map(self._plans.pop, keys, repeat(None)))
            first = entries[0] if entries else None
            # the usual job: the keys of one plan, stored
            if not (first is not None and success and self._fast is not None and len(first[2]) == len(keys)
                    and len(set(map(id, entries))) == 1 and self._fast.settle(*first)):
                settled: set[int] = set()
                for entry in entries:
                    if entry is not None and id(entry[0]) not in settled:
                        settled.add(id(entry[0]))
                        self._core.settle(entry[0], entry[1], ok=success)
        storing = self._storing
        counts = list(map(storing.pop, keys, repeat(0)))
        if counts.count(1) == len(counts):  # the usual job: each key stored once, by this job
            done = list(keys)
        else:  # put the counts back, then one key at a time (a key twice in the job counts twice)
            storing.update((key, count) for key, count in zip(keys, counts, strict=True) if count)
            done = []
            pop = storing.pop
            for key in keys:
                count = pop(key, 0)
                if count == 1:
                    done.append(key)
                elif count:
                    storing[key] = count - 1
        if self._events is not None and success and done:
            self._events.append((done, False))

    # --- removals and events ------------------------------------------------------------------------
    def take_removed(self) -> list[bytes]:
        """Offload keys of blocks that left every kvtier tier since the last report (each reported once)."""
        if not self.runtime.mirror.removed:
            return []
        removed = self.runtime.mirror.take_removed()
        if self._events is not None:
            self._events.append((removed, True))
        return removed

    def take_event_keys(self) -> list[tuple[list[bytes], bool]]:
        """The ``(offload keys, removed)`` events since the last call, oldest first."""
        if self._events is None:
            return []
        self.take_removed()
        events, self._events = self._events, []
        return events

    # --- slow tiers with the workers in other processes: the stage channel ---------------------------
    def _stage_round(self) -> None:
        """Send this step's chains to every rank (one request per rank), the releases due, and expire
        promises no load took."""
        assert self._stage is not None
        if self._fetch_queue:
            chains = list(self._fetch_queue.values())
            futures = self._stage.submit([[block_key for _, block_key in chain] for chain in chains])
            self.counters.fetches += 1
            orphans = []  # stored (or reset) since their lookup: staged for nobody
            for chain, future in zip(chains, futures, strict=True):
                self.counters.fetched_blocks += len(chain)
                for position, (key, _) in enumerate(chain):
                    queued = self._fetching.get(key)
                    if queued is not None:
                        queued.future = future
                    else:
                        orphans.append((key, _Fetch(False, position, future)))
            if orphans:
                self._release_when_staged(orphans)
            self._fetch_queue.clear()
        now = time.monotonic()
        if self._promised and now >= self._next_expiry:
            self._next_expiry = now + 1.0
            stale = [key for key, p in self._promised.items() if not p.leases and now - p.since > PROMISE_TTL]
            if stale:
                self._stage.release([self._promised.pop(key).block_key for key in stale])
        if self._stage.has_releases():
            self._stage.flush()

    def _settle_stage(self, key: bytes, block_key: BlockKey, fetch: _Fetch) -> bool:
        """A stage round answered for this key: promised if every rank staged it; a rank that found it
        missing or corrupt makes it a miss that leaves this index (and, with the next plan, the others)."""
        if key in self._loadable:  # stored into a memory tier meanwhile: that copy is the hit
            if fetch.staged_it():
                assert self._stage is not None
                self._stage.release([block_key])
            return True
        if fetch.staged_it():
            self._promised[key] = _Promise(block_key, time.monotonic())
            return True
        self._absent[key] = time.monotonic() + self._absent_ttl
        if fetch.lost_it():
            self._forget_lost(block_key)
        return False

    def _forget_lost(self, block_key: BlockKey) -> None:
        """Drop a slow-tier block one rank lost from this index; reported removed to vLLM."""
        core, tiers = self._core, self._residency.tiers
        with core._index_lock:
            held = [t for t in self.runtime.slow_tiers
                    if tiers[t].is_ready(block_key) and block_key not in tiers[t].pins]
            for t in held:
                self._residency.forget(t, block_key)
            if held:
                core._changed([block_key])
                core._report_removed([block_key])
        if held:
            self._lost_drops += [(t, block_key) for t in held]
            self.counters.lost_blocks += 1

    def _lease_promised(self, keys: Sequence[bytes], pinned: Sequence[int | None]) -> tuple[int, ...]:
        """Sources of a load: memory tiers where pinned, else :data:`STAGED` for a promised block."""
        sources = []
        for key, where in zip(keys, pinned, strict=True):
            if where is not None:
                sources.append(where)
                continue
            promise = self._promised.get(key)
            if promise is None:
                sources.append(LOST)
            else:
                promise.leases += 1
                sources.append(STAGED)
        return tuple(sources)

    def _release_promised(self, keys: Sequence[bytes],
                          released: list[tuple[BlockKey, int]]) -> list[tuple[BlockKey, int]]:
        """Drop the loads' holds on promised blocks; a block no load holds any more is released on every
        rank (vLLM completes a load once every worker read it). Returns the memory-tier pins left."""
        assert self._stage is not None
        done: list[BlockKey] = []
        by_block = {promise.block_key: key for key in keys
                    if (promise := self._promised.get(key)) is not None}
        for block_key, source in released:
            key = by_block.get(block_key) if source == STAGED else None
            promise = self._promised.get(key) if key is not None else None
            if key is None or promise is None:
                continue
            promise.leases -= 1
            if promise.leases <= 0:
                del self._promised[key]
                done.append(block_key)
        if done:
            self._stage.release(done)
        return [(k, t) for k, t in released if t != STAGED]

    def _abandon_stages(self) -> None:
        """A reset: what rounds in flight stage, and promises no load holds, are released on the ranks."""
        assert self._stage is not None
        self._release_when_staged(list(self._fetching.items()))
        unheld = [key for key, promise in self._promised.items() if not promise.leases]
        self._stage.release([self._promised.pop(key).block_key for key in unheld])

    def _release_when_staged(self, fetches: Sequence[tuple[bytes, _Fetch]]) -> None:
        """Nobody will load what these stages hold: each copy is released on every rank once staged."""
        assert self._stage is not None
        stage = self._stage
        pending: dict[int, tuple[concurrent.futures.Future[Any], list[tuple[BlockKey, int]]]] = {}
        for key, fetch in fetches:
            if fetch.future is not None:
                entry = pending.setdefault(id(fetch.future), (fetch.future, []))
                entry[1].append((self._codec.block_key(key), fetch.position))
        for future, entries in pending.values():
            def release(done: concurrent.futures.Future[Any],
                        entries: list[tuple[BlockKey, int]] = entries) -> None:
                staged = _staged_count(done.result()) if done.exception() is None else 0
                stage.release([block_key for block_key, position in entries if position < staged])
            future.add_done_callback(release)

    # --- lifecycle ------------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget every block (vLLM's ``reset_prefix_cache(reset_connector=True)``).

        In-flight manager state and staged copies go; the runtime moves to a fresh key epoch (nothing
        stored before is served again, from any tier) and empties its memory tiers.
        """
        self._storing.clear()
        if self._stage is not None:
            self._abandon_stages()
        self._fetching.clear()
        self._fetch_queue.clear()
        self._absent.clear()
        self._used.clear()
        dropped = self.runtime.reset()
        if self._placed:  # the workers hold these bytes: the next store's plan deletes them there
            self._reset_drops += dropped

    def kvtier_stats(self) -> CacheStats:
        return self.runtime.stats()
