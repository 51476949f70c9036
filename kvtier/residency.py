"""Which tier holds which block, and the plan of moves a store or a promotion needs.

This is the metadata half of :class:`kvtier.cache.TieredCache`: tier indexes, pins, byte usage,
eviction policies and placement decisions — no bytes. The cache executes the :class:`Plan` it
returns against real tiers; ``kvtier replay`` executes the same plans against nothing and counts
what would have moved. One implementation, so a replayed policy is the policy the cache runs.

Entry states: ``PENDING`` (space reserved, bytes in flight: invisible to lookups, never evicted),
``READY`` (readable), and removed. Pinned entries (in-flight reads) are never chosen as victims.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.blocks import BlockKey, all_of_group
from kvtier.policy import EvictionPolicy, InsertHint, make_eviction_policy
from kvtier.policy.admission import AdmitAll
from kvtier.policy.placement import PlacementPolicy

PENDING = 0
READY = 1
_NO_HINT = InsertHint()


class TierIndex:
    """Metadata of one tier: resident keys per group partition, their state, pins and policy.

    A *self-evicting* tier (Redis) keeps no entries: its server evicts on its own, so kvtier never
    claims to know what it holds (lookups ask the tier itself).
    """

    def __init__(self, name: str, capacity: Mapping[int, int], block_bytes: Mapping[int, int],
                 eviction: str = "default", *, self_evicting: bool = False,
                 policies: Mapping[int, EvictionPolicy] | None = None) -> None:
        self.name = name
        self.self_evicting = self_evicting
        self.capacity = dict(capacity)
        self.block_bytes = dict(block_bytes)
        self.used = dict.fromkeys(self.block_bytes, 0)
        self.policies: dict[int, EvictionPolicy] = (
            dict(policies) if policies is not None
            else {g: make_eviction_policy(eviction) for g in self.block_bytes})
        self.entries: dict[BlockKey, int] = {}
        self.pins: dict[BlockKey, int] = {}
        #: The chain links of entries stored with one (key -> predecessor), and those entries' positions
        #: where not 0, so a demoted or promoted block keeps its chain below (:meth:`hint`). Kept as keys
        #: and ints, not the InsertHint objects: no object per cached block for Python's garbage
        #: collector to walk (docs/architecture.md#threads). ``request_id`` does not travel.
        self.links: dict[BlockKey, BlockKey] = {}
        self.positions: dict[BlockKey, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def is_ready(self, key: BlockKey) -> bool:
        return self.entries.get(key) == READY

    def pin(self, key: BlockKey) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> None:
        count = self.pins.get(key, 0) - 1
        if count > 0:
            self.pins[key] = count
        else:
            self.pins.pop(key, None)

    def pin_many(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`pin` of each of ``keys``; the usual batch (distinct keys, none pinned: a load's) in
        C-level passes."""
        pins = self.pins
        if len(distinct := dict.fromkeys(keys, 1)) == len(keys) and pins.keys().isdisjoint(distinct):
            pins.update(distinct)
            return
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def unpin_many(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`unpin` of each of ``keys``; the usual batch (distinct keys pinned once) in C-level
        passes."""
        pins = self.pins
        if list(map(pins.get, keys)).count(1) == len(keys) and len(set(keys)) == len(keys):
            deque(map(pins.__delitem__, keys), maxlen=0)
            return
        for key in keys:
            self.unpin(key)

    def fits(self, group_id: int) -> bool:
        """Whether this tier can ever hold a block of the group (capacity of at least one block)."""
        return self.self_evicting or self.capacity.get(group_id, 0) >= self.block_bytes.get(group_id, 1 << 62)

    def add(self, key: BlockKey, hint: InsertHint, *, ready: bool) -> None:
        """Record ``key`` (space must have been made); a pending entry is pinned until :meth:`settle`."""
        if self.self_evicting:
            return
        self.entries[key] = READY if ready else PENDING
        self.used[key.group_id] += self.block_bytes[key.group_id]
        if hint.predecessor is not None:
            self.links[key] = hint.predecessor
            if hint.position:
                self.positions[key] = hint.position
        self.policies[key.group_id].insert(key, hint)
        if not ready:
            self.pin(key)

    def settle(self, key: BlockKey, ok: bool) -> None:
        """A pending write finished: make it readable, or forget it if it failed."""
        if self.self_evicting or key not in self.entries:
            return
        self.unpin(key)
        if ok:
            self.entries[key] = READY
        else:
            self.discard(key)

    def settle_many(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """:meth:`settle` of each of ``keys`` (one call per batch: a store's hot path)."""
        if self.self_evicting:
            return
        entries, pins = self.entries, self.pins
        if ok and keys and entries.keys() >= set(keys):
            # every key indexed (a store's pending writes): unpinned (in C-level passes for the usual
            # batch, distinct keys pinned once) and READY
            self.unpin_many(keys)
            entries.update(dict.fromkeys(keys, READY))
            return
        for key in keys:
            if key not in entries:
                continue
            count = pins.get(key, 0) - 1  # unpin, inlined
            if count > 0:
                pins[key] = count
            else:
                pins.pop(key, None)
            if ok:
                entries[key] = READY
            else:
                self.discard(key)

    def discard(self, key: BlockKey) -> bool:
        """Forget ``key`` (evicted, deleted, or found corrupt). Returns whether it was present."""
        if self.entries.pop(key, None) is None:
            return False
        self.used[key.group_id] -= self.block_bytes[key.group_id]
        self.drop_links((key,))
        self.policies[key.group_id].remove(key)
        return True

    def victims_for(self, group_id: int, extra_bytes: int) -> list[BlockKey] | None:
        """Unpinned keys whose removal lets ``extra_bytes`` more fit; None if that is impossible."""
        if self.self_evicting:
            return []
        need = self.used[group_id] + extra_bytes - self.capacity[group_id]
        if need <= 0:
            return []
        per_block = self.block_bytes[group_id]
        count = -(-need // per_block)
        victims = self.policies[group_id].victims(count, self.pins)
        return victims if len(victims) == count else None

    def drop_links(self, keys: Iterable[BlockKey]) -> None:
        """Forget the chain links (and positions) of ``keys``, entries that are leaving the tier."""
        links, positions = self.links, self.positions
        if links:
            for key in keys:
                if links.pop(key, None) is not None:
                    positions.pop(key, None)

    def hint(self, key: BlockKey) -> InsertHint:
        """The chain hint ``key`` was stored with (its predecessor and position; a default hint when it
        carried no predecessor)."""
        predecessor = self.links.get(key)
        if predecessor is None:
            return _NO_HINT
        return InsertHint(self.positions.get(key, 0), predecessor=predecessor)

    def usage(self) -> int:
        return sum(self.used.values())

    def keys(self) -> Iterable[BlockKey]:
        return self.entries.keys()


@dataclass
class Plan:
    """Moves that make a store or promotion happen, in the order the executor runs them.

    ``demotions[t]``: (key, destination tier) copies out of tier ``t``, then ``drops[t]`` deletes
    from ``t``; both run for ``t`` from the bottom tier up, so a tier's room exists before data
    arrives. Then ``writes[t]``: indexes into the caller's keys/buffers written into tier ``t``.
    ``skipped``: caller indexes already stored (they were only touched).
    """

    num_tiers: int
    demotions: list[list[tuple[BlockKey, int]]] = field(default_factory=list)
    drops: list[list[BlockKey]] = field(default_factory=list)
    writes: list[list[int]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.demotions = [[] for _ in range(self.num_tiers)]
        self.drops = [[] for _ in range(self.num_tiers)]
        self.writes = [[] for _ in range(self.num_tiers)]

    @property
    def empty(self) -> bool:
        return not any(self.demotions) and not any(self.drops) and not any(self.writes)


@dataclass
class Promotion:
    """A :class:`Plan` that copies lower-tier hits up to ``target``, and where each copy came from.

    The plan's write indexes refer to ``keys``; ``indexes[j]`` is the position of ``keys[j]`` in the
    caller's request (to pick its buffer), ``sources[j]`` the tier it was read from.
    """

    plan: Plan
    target: int
    keys: list[BlockKey]
    indexes: list[int]
    sources: list[int]


class Residency:
    """Tier indexes top → bottom plus the placement policy; builds plans and applies outcomes."""

    def __init__(self, tiers: Sequence[TierIndex], placement: PlacementPolicy) -> None:
        if len(tiers) != placement.num_tiers:
            raise ValueError(f"{len(tiers)} tiers but placement rules for {placement.num_tiers}")
        self.tiers = list(tiers)
        self.placement = placement
        #: (tier, group) partitions that could not make room during the plan being built: the keys
        #: added meanwhile are pinned, so no later key of that plan finds room there either.
        self._full: set[tuple[int, int]] = set()

    # --- lookups ---------------------------------------------------------------------------------
    def locate(self, key: BlockKey) -> int | None:
        """Top-most tier holding a READY copy of ``key`` (self-evicting tiers are not consulted)."""
        for t, index in enumerate(self.tiers):
            if index.entries.get(key) == READY:
                return t
        return None

    def locate_all(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """:meth:`locate` of each key; with one tier holding every key READY (a load's usual batch) in
        C-level passes."""
        if len(self.tiers) == 1 and list(map(self.tiers[0].entries.get, keys)).count(READY) == len(keys):
            return [0] * len(keys)
        return [self.locate(key) for key in keys]

    def locate_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Tiers of the leading run of keys with a known READY copy; stops at the first unknown."""
        found: list[int] = []
        for key in keys:
            t = self.locate(key)
            if t is None:
                break
            found.append(t)
        return found

    def touch(self, tier: int, key: BlockKey) -> None:
        self.tiers[tier].policies[key.group_id].access(key)

    def touch_all(self, tier: int, keys: Sequence[BlockKey]) -> None:
        """:meth:`touch` of each of ``keys`` in order: one policy call when they share a group (a load's
        hits)."""
        if keys and all_of_group(keys, group_id := keys[0].group_id):
            self.tiers[tier].policies[group_id].access_all(keys)
            return
        for key in keys:
            self.touch(tier, key)

    # --- planning ----------------------------------------------------------------------------------
    def plan_store(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None = None, *,
                   only_tier: int | None = None) -> Plan:
        """Reserve room and entries for storing ``keys``; the caller must execute the plan.

        With ``only_tier`` (promotions) the block goes to that tier alone. A key already present in
        a target tier is touched, not rewritten. A tier that cannot make room (everything pinned)
        is skipped; with write-back the next tier down is tried.
        """
        plan = Plan(len(self.tiers))
        self._full.clear()
        target = only_tier if only_tier is not None else 0 if len(self.tiers) == 1 else None
        if target is not None and self._plan_batch(target, keys, hints, plan):
            return plan
        write_through = self.placement.write_mode == "write_through"
        # per target tier, hoisted out of the per-key loop (an engine's scheduler plans every store here)
        targets = [(t, self.tiers[t], self.placement.admission[t].admit, plan.writes[t])
                   for t in ([only_tier] if only_tier is not None else range(len(self.tiers)))]
        skipped = plan.skipped
        for i, key in enumerate(keys):
            placed = wrote = False
            for t, index, admit, writes in targets:
                if key in index.entries:
                    index.policies[key.group_id].access(key)  # Residency.touch
                    placed = True
                    if write_through:
                        continue
                    break
                if key in index.pins:
                    continue  # a load reads an older copy here: never overwrite (docs/architecture.md#pins)
                if not index.fits(key.group_id) or not admit(key):
                    continue
                if not self._make_room(t, key.group_id, plan):
                    continue
                index.add(key, hints[i] if hints is not None else InsertHint(position=i), ready=False)
                writes.append(i)
                placed = wrote = True
                if not write_through:
                    break
            if placed and not wrote:
                skipped.append(i)
        return plan

    def _plan_batch(self, t: int, keys: Sequence[BlockKey], hints: Sequence[InsertHint] | None,
                    plan: Plan) -> bool:
        """:meth:`plan_store` into one tier in one policy call, when that gives the same plan as key by key.

        That is: one group, new distinct keys (none indexed or pinned there), a tier that admits all,
        is not over its capacity and demotes nothing. Key by key, the first keys that fit are added,
        each later one evicts one victim, and once no victim is left no later key can be stored either
        (the keys added meanwhile are pinned, and only they are added); the policy's
        :meth:`~kvtier.policy.base.EvictionPolicy.store_new` runs exactly that sequence, with no
        per-key plan bookkeeping (an engine's scheduler plans every store here). Returns False, having
        changed nothing, when the key-by-key path must run.
        """
        if not keys or type(self.placement.admission[t]) is not AdmitAll:
            return False
        if self.placement.write_mode == "write_back" and t + 1 < len(self.tiers):
            return False  # victims are demoted: key by key
        index = self.tiers[t]
        group_id = keys[0].group_id
        policy = index.policies.get(group_id)
        if policy is None or index.self_evicting or not index.fits(group_id):
            return False
        entries, pins = index.entries, index.pins
        if not all_of_group(keys, group_id) or len(distinct := set(keys)) != len(keys) or not (
                entries.keys().isdisjoint(distinct) and pins.keys().isdisjoint(distinct)):
            return False
        per_block = index.block_bytes[group_id]
        room = index.capacity[group_id] - index.used[group_id]
        if room < 0:
            return False  # over capacity (more than one victim per key): key by key
        pins.update(dict.fromkeys(keys, 1))  # pending and pinned before any victim is chosen
        if hints is not None:
            batch_hints: Sequence[InsertHint] = hints
        elif policy.reads_positions:
            batch_hints = [InsertHint(position=i) for i in range(len(keys))]
        else:  # the policy reads only the hints' predecessors: one shared hint, no object per key
            batch_hints = [_NO_HINT] * len(keys)
        stored, victims = policy.store_new(keys, batch_hints, pins, room // per_block)
        if stored < len(keys):
            for key in keys[stored:]:
                del pins[key]
            keys = keys[:stored]
            if hints is not None:
                hints = hints[:stored]
        for victim in victims:  # TierIndex.discard, batched (the policy has removed them)
            del entries[victim]
        index.drop_links(victims)
        plan.drops[t].extend(victims)
        entries.update(dict.fromkeys(keys, PENDING))  # TierIndex.add(ready=False), batched
        if hints is not None:
            chained = [(key, hint.predecessor, hint.position) for key, hint in zip(keys, hints, strict=True)
                       if hint.predecessor is not None]
            index.links.update({key: predecessor for key, predecessor, _ in chained})
            index.positions.update({key: position for key, _, position in chained if position})
        index.used[group_id] += (stored - len(victims)) * per_block
        plan.writes[t].extend(range(stored))
        return True

    def _make_room(self, t: int, group_id: int, plan: Plan) -> bool:
        if (t, group_id) in self._full:
            return False  # a victim walk over the same pinned keys would fail again
        index = self.tiers[t]
        victims = index.victims_for(group_id, index.block_bytes[group_id])
        if victims is None:
            self._full.add((t, group_id))
            return False
        if not victims:
            return True
        write_back = self.placement.write_mode == "write_back" and t + 1 < len(self.tiers)  # a tier below
        drops = plan.drops[t]
        for victim in victims:
            hint = index.hint(victim)
            index.discard(victim)
            dst = self._demotion_target(t, victim, hint, plan) if write_back else None
            if dst is not None:
                index.pin(victim)  # read by the demotion copy before it is dropped
                plan.demotions[t].append((victim, dst))
            drops.append(victim)
        return True

    def _demotion_target(self, t: int, key: BlockKey, hint: InsertHint, plan: Plan) -> int | None:
        if self.placement.write_mode != "write_back":
            return None
        for u in range(t + 1, len(self.tiers)):
            lower = self.tiers[u]
            if key in lower.entries:
                return None  # a copy already lives below (inclusive caching): nothing to write
            if key in lower.pins:
                continue  # a load reads an older copy there: never overwrite (docs/architecture.md#pins)
            if not lower.fits(key.group_id) or not self.placement.admission[u].admit(key):
                continue
            if self._make_room(u, key.group_id, plan):
                lower.add(key, hint, ready=False)  # the chain link travels with the block
                return u
        return None

    def plan_promotion(self, keys: Sequence[BlockKey], found: Sequence[int]) -> Promotion | None:
        """Plan copying the hits ``keys[i]`` (read from tier ``found[i]``) up, as the placement says.

        None when nothing is to be promoted. Each copy keeps the chain link its lower copy was stored
        with (or, without one, its position in ``keys``), so chain-aware eviction sees the same chain
        in every tier. The caller executes ``plan`` with the bytes it just read (no extra read), then
        calls :meth:`finish_promotion`. The one promotion step of the cache and of ``kvtier replay``.
        """
        should_promote = self.placement.should_promote
        todo = [i for i, t in enumerate(found) if should_promote(t)]
        if not todo:
            return None
        sources = [found[i] for i in todo]
        sub = [keys[i] for i in todo]
        hints = [self.tiers[t].hint(key) if key in self.tiers[t].links else InsertHint(position=i)
                 for i, t, key in zip(todo, sources, sub, strict=True)]
        target = self.placement.promote_to
        return Promotion(self.plan_store(sub, hints, only_tier=target), target, sub, todo, sources)

    def finish_promotion(self, promotion: Promotion, done: Iterable[int]) -> dict[int, list[BlockKey]]:
        """The copies ``done`` (indexes into ``promotion.keys``) landed: with exclusive caching
        (``keep_lower_copy`` off) drop their lower copies from the index, and return them per tier for
        the caller to delete. A lower copy that is pinned (another load reads it) or in a self-evicting
        tier stays: the block is then held in both tiers, as with inclusive caching."""
        if self.placement.keep_lower_copy:
            return {}
        dropped: dict[int, list[BlockKey]] = {}
        for j in done:
            src, key = promotion.sources[j], promotion.keys[j]
            index = self.tiers[src]
            if index.self_evicting or key in index.pins:
                continue
            if index.discard(key):
                dropped.setdefault(src, []).append(key)
        return dropped

    # --- outcomes ----------------------------------------------------------------------------------
    def finish_demotion(self, src: int, dst: int, key: BlockKey, ok: bool) -> None:
        self.tiers[src].unpin(key)
        self.tiers[dst].settle(key, ok)

    def finish_write(self, tier: int, key: BlockKey, ok: bool) -> None:
        self.tiers[tier].settle(key, ok)

    def forget(self, tier: int, key: BlockKey) -> None:
        """A tier reported ``key`` missing or corrupt: drop it from the index."""
        self.tiers[tier].discard(key)
