"""The default: leaf-first eviction, with learned per-class lifetimes where the workload rewards them.

Two experts over one set of structures: leaf-first LRU (:mod:`kvtier.policy.chains`), which keeps
chains whole, and learned lifetimes (:mod:`kvtier.policy.lifetime`), which recognise dead blocks.
Only leaves are candidates, so tails leave before heads whichever expert decides; which one decides
is learned online from the reuse distances of resident and ghost keys. docs/policies.md explains why
and shows the results.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Sequence
from itertools import chain, islice
from operator import attrgetter, itemgetter
from typing import Any
from zlib import crc32

from kvtier.blocks import BlockKey
from kvtier.policy.base import InsertHint, take_unpinned
from kvtier.policy.chains import ChainForest
from kvtier.policy.lifetime import _NEVER_KEEP, _SAMPLE_SHIFT, _SUB, LearnedLifetimePolicy, _bin
from kvtier.policy.probation import PROTECTED_SHARE, Excluding, ProbationLane

_STALE = object()  # store_new: a class's front (oldest unpinned leaf) must be found again
_predecessor = attrgetter("predecessor")
_second = itemgetter(1)


def _last_reference(front: tuple[int, BlockKey, int]) -> int:
    return front[2]


class AdaptiveChainPolicy(LearnedLifetimePolicy):
    """Leaf-first eviction by learned per-class lifetimes, or by recency where they gain nothing
    (module docstring).

    ``capacity`` (blocks) as for :class:`LearnedLifetimePolicy`; without it, the most blocks held.
    """

    name = "adaptive"
    reads_positions = False  # store_new reads only the hints' predecessors

    def __init__(self, capacity: int | None = None, *, classes: int = 3, min_gain: float = 0.02) -> None:
        super().__init__(capacity, classes=classes, min_gain=min_gain)
        self.chains = ChainForest()
        # resident blocks with resident successors; their last reference lives in their record
        # (``_meta[key][2]``, -1 for every other block), so a hit on one (most hits) changes no dict
        self._inner: dict[BlockKey, None] = {}
        self._detached: dict[BlockKey, int] = {}  # detached leaves -> last reference
        # leaves that re-entered a class queue out of time order, with a heap of them (stale skipped)
        self._late: list[dict[BlockKey, int]] = [{} for _ in range(classes)]
        self._late_heap: list[list[tuple[int, BlockKey]]] = [[] for _ in range(classes)]
        # chains stored by a request that missed its head leave first, newest first (loop resistance)
        self.probation = ProbationLane()

    @property
    def leader(self) -> str:
        """Which expert decides now: ``lifetime`` (learned per-class lifetimes) or ``leaf_lru``."""
        return "lifetime" if self._learned else "leaf_lru"

    # --- where a key's time lives ------------------------------------------------------------------
    def _to_leaf(self, key: BlockKey, t: int) -> None:
        """``key`` (last referenced at ``t``) has no resident successor any more: queue it by its time."""
        if key in self.chains.detached:
            self._detached[key] = t
            return
        cls = self._meta[key][0]
        queue = self._queues[cls]
        if not queue or t >= queue[next(reversed(queue))]:
            queue[key] = t
        elif t <= queue[next(iter(queue))]:  # the usual case: a parent is older than its successors
            queue[key] = t
            queue.move_to_end(key, last=False)
        else:
            self._late[cls][key] = t
            heapq.heappush(self._late_heap[cls], (t, key))

    def _from_leaf(self, key: BlockKey) -> int:
        """Take ``key`` out of the leaf queues (or the detached lane); returns its last reference."""
        cls = self._meta[key][0]
        t = self._queues[cls].pop(key, None)
        if t is None:
            t = self._late[cls].pop(key, None)
            if t is None:
                t = self._detached.pop(key)
        return t

    # --- EvictionPolicy ----------------------------------------------------------------------------
    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        meta = self._meta
        if key in meta:
            self.access(key)
            return
        # the lifetime policy's insert: the key's class from its ghost entry, if any
        h = crc32(*key)
        t = self._clock = self._clock + 1
        cls = self._class_of_new(h, t)
        record = meta[key] = [cls, h, -1]
        queue = self._queues[cls]
        queue[key] = t
        if t >= self._next_refit:
            self._refit()
        parent, inner, attached, detached = self.chains.link(key, hint.predecessor, meta)
        if parent is not None and parent not in self._inner:
            self._inner[parent] = None
            meta[parent][2] = self._from_leaf(parent)
        for k in attached:
            then = self._detached.pop(k, None)
            if then is not None:
                self._to_leaf(k, then)
        for k in detached:
            if k not in self._inner:
                self._detached[k] = self._from_leaf(k)
        if inner:
            self._inner[key] = None
            record[2] = queue.pop(key)
        elif key in self.chains.detached:
            self._detached[key] = queue.pop(key)
        self.probation.stored(key, hint.predecessor, t, not inner)

    def access(self, key: BlockKey) -> None:
        # the lifetime policy's access, inlined, for a key in whichever lane holds it: a queued leaf
        # moves to its new class's queue; an inner or detached block stays aside with its new time;
        # a late leaf is now the newest of its new class
        meta = self._meta.get(key)
        if meta is None:
            return
        t = self._clock = self._clock + 1
        self.probation.touched(key)
        old, h, then = meta
        cls = meta[0] = old + 1 if old < self._top else old
        if then >= 0:  # first: most hits are inner blocks of a cached prefix
            meta[2] = t
        else:
            then = self._queues[old].pop(key, -1)
            if then >= 0:
                self._queues[cls][key] = t
            else:
                then = self._late[old].pop(key, -1)
                if then >= 0:
                    self._queues[cls][key] = t
                else:
                    detached = self._detached
                    then = detached[key]
                    detached[key] = t
        if not h >> _SAMPLE_SHIFT:
            d = t - then
            if d <= self._reach:
                e = d.bit_length() - 1  # _bin(d), inlined
                self._hist[old][e * _SUB + ((d >> (e - 2)) & 3) if e >= 2 else _bin(d)] += 1.0
            self._refs[cls] += 1.0
        if t >= self._next_refit:
            self._refit()

    def remove(self, key: BlockKey) -> None:
        meta = self._meta.pop(key, None)
        if meta is None:
            return
        cls, h, then = meta
        if then >= 0:
            del self._inner[key]
        else:
            then = self._queues[cls].pop(key, -1)
            if then < 0:
                then = self._late[cls].pop(key, -1)
                if then < 0:
                    then = self._detached.pop(key)
        self._table[h & self._slot_mask] = (then << 20) | ((h >> 16) << 4) | cls  # the ghost entry
        parent, detached = self.chains.unlink(key, self._meta)
        for k in detached:
            if k not in self._inner:
                self._detached[k] = self._from_leaf(k)
        self.probation.left(key)
        if parent is not None and parent in self._inner:
            del self._inner[parent]
            record = self._meta[parent]
            t, record[2] = record[2], -1
            self._to_leaf(parent, t)
            self.probation.became_leaf(parent)

    # --- batches: the per-key methods above, inlined into one loop (same calls, same order) ---------
    def access_all(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`access` of each key in order (a request's prefix hits)."""
        meta_of = self._meta.get
        queues, late, detached = self._queues, self._late, self._detached
        top, hist, refs, reach, next_refit = self._top, self._hist, self._refs, self._reach, self._next_refit
        # ProbationLane.touched, inlined: a hit ends probation (the lane never replaces these dicts)
        on_probation, fresh_roots = self.probation.members, self.probation.fresh_roots
        t = self._clock
        for key in keys:
            meta = meta_of(key)
            if meta is None:
                continue
            t += 1
            if on_probation and on_probation.pop(key, None) is not None:
                pass
            elif fresh_roots:
                fresh_roots.pop(key, None)
            old, h, then = meta
            cls = meta[0] = old + 1 if old < top else old
            if then >= 0:
                meta[2] = t
            else:
                then = queues[old].pop(key, -1)
                if then >= 0:
                    queues[cls][key] = t
                else:
                    then = late[old].pop(key, -1)
                    if then >= 0:
                        queues[cls][key] = t
                    else:
                        then = detached[key]
                        detached[key] = t
            if not h >> _SAMPLE_SHIFT:
                d = t - then
                if d <= reach:
                    e = d.bit_length() - 1
                    hist[old][e * _SUB + ((d >> (e - 2)) & 3) if e >= 2 else _bin(d)] += 1.0
                refs[cls] += 1.0
            if t >= next_refit:
                self._clock = t
                self._refit()  # may resize and replaces the statistics: fetch them again
                hist, refs, reach, next_refit = self._hist, self._refs, self._reach, self._next_refit
        self._clock = t

    def store_new(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint], pinned: Container[BlockKey],
                  free: int) -> tuple[int, list[BlockKey]]:
        """:meth:`EvictionPolicy.store_new`: per key, :meth:`victims` (one), :meth:`remove` and
        :meth:`insert` with their usual cases inlined (the probation lane's bookkeeping too); anything
        unusual calls the method itself.

        The lane's heap entry for a stored leaf waits in ``pending`` until the next key is stored (or
        the batch ends): most stored leaves are parents of the very next key, whose entry would only
        be skipped as stale, and the lane never chooses it meanwhile as it is pinned (the entries that
        can be chosen are the same; pushing it before each lane victim cost a push, a pop and a push).
        """
        flat = self._store_unlinked(keys, hints, pinned, free)
        if flat is not None:
            return flat
        out: list[BlockKey] = []
        meta_of = self._meta
        queues, late, late_heaps = self._queues, self._late, self._late_heap
        inner, lane_detached = self._inner, self._detached
        chains = self.chains
        pred_of, children, chain_detached = chains.pred, chains.children, chains.detached
        to_leaf = self._to_leaf
        top = self._top
        # the learned state, fetched again after each refit (which may also resize the ghost table)
        table, slot_mask, reach = self._table, self._slot_mask, self._reach
        repeat_within, hist, refs, next_refit = self._repeat_within, self._hist, self._refs, self._next_refit
        weights, learned = self.weights, self._learned
        probation = self.probation
        members, fresh_roots = probation.members, probation.fresh_roots  # never replaced
        heap = probation.heap  # replaced when the lane compacts it: fetched again after victim()
        pending: tuple[int, BlockKey] | None = None
        heappush = heapq.heappush
        # the leader's candidates: per class, its oldest unpinned leaf as (key, time) (queued or late),
        # None when it has none, or _STALE (find it again); None for the whole list until first asked.
        # Pinned keys never change a front, so a batch's own keys leave it alone; a class's entry goes
        # stale when an unpinned leaf leaves it, takes a parent that becomes a leaf if older, and
        # anything unusual (a refit, detaching, adopting) drops the list. Rescanning three queues per
        # victim was a quarter of the default's store cost.
        fronts: list[Any] | None = None
        inner_by_age = _InnerByAge(inner, meta_of, pinned)  # renewed when an unpinned key turns inner
        i = 0
        for key in keys:
            if i >= free:
                # --- victims(1, pinned): the probation lane first where it decides, then the leader's
                # order with its common case inlined
                victim = None
                if not lane_detached and members:
                    resident = len(meta_of)
                    if resident - len(members) <= PROTECTED_SHARE * resident:  # ProbationLane.applies
                        # ProbationLane.victim's usual case inlined: the heap's top is a live probation
                        # leaf outside the batch; popped, as it leaves now (its entry would go stale)
                        if heap and len(heap) <= 2 * len(members) + 64:
                            head_t, head_key = heap[0]
                            if members.get(head_key) == -head_t and head_key not in inner \
                                    and head_key not in pinned:
                                victim = head_key
                                heapq.heappop(heap)
                        if victim is None:  # stale entries, a pinned top, or a compaction due
                            victim = probation.victim(pinned, inner)  # pending's key is pinned: not needed
                            heap = probation.heap
                if victim is None and not lane_detached:
                    # the leader's order over each class's front (its oldest unpinned leaf, queued or
                    # late), the fronts kept across the batch
                    if fronts is None:
                        fronts = [_STALE] * len(queues)
                    now = self._clock + 1
                    best_score = -1.0
                    for c, front in enumerate(fronts):
                        if front is _STALE:
                            front = None
                            for cand, t in queues[c].items():
                                if cand not in pinned:
                                    front = (cand, t)
                                    break
                            lc = late[c]
                            if lc:
                                lheap = late_heaps[c]
                                while lheap and lc.get(lheap[0][1]) != lheap[0][0]:
                                    heapq.heappop(lheap)
                                if lheap and (front is None or lheap[0][0] < front[1]):
                                    if lheap[0][1] in pinned:
                                        victim = None
                                        break  # rare: the careful walk (the entry stays stale)
                                    front = (lheap[0][1], lheap[0][0])
                            fronts[c] = front
                        if front is None:
                            continue
                        if learned:
                            if weights[c] == _NEVER_KEEP:
                                victim = front[0]
                                break
                            score = (now - front[1]) * weights[c]
                        else:
                            score = now - front[1]
                        if score > best_score:
                            victim, best_score = front[0], score
                if victim is None:  # detached leaves, a pinned late leaf, or no unpinned leaf at all
                    chosen = self._victims(1, pinned, inner_by_age)  # (the lane was asked above)
                    if not chosen:
                        if pending is not None:
                            heappush(heap, pending)
                        return i, out
                    victim = chosen[0]
                out.append(victim)
                # --- remove(victim), inlined
                cls, h, then = meta_of.pop(victim)
                if then >= 0:
                    del inner[victim]
                else:
                    then = queues[cls].pop(victim, -1)
                    if then < 0:
                        then = late[cls].pop(victim, -1)
                        if then < 0:
                            then = lane_detached.pop(victim)
                    if fronts is not None:
                        fronts[cls] = _STALE  # it was, most likely, its class's front
                table[h & slot_mask] = (then << 20) | ((h >> 16) << 4) | cls
                parent = None
                pred = pred_of.pop(victim, None)  # ChainForest.unlink, inlined
                if pred is not None:
                    kids = children[pred]
                    kids.remove(victim)
                    if not kids:
                        del children[pred]
                        if pred in meta_of:
                            parent = pred
                if victim in chain_detached or victim in children:
                    fronts = None
                    for k in chains.release(victim):
                        if k not in inner:
                            lane_detached[k] = self._from_leaf(k)
                if members.pop(victim, None) is None and fresh_roots:  # ProbationLane.left
                    fresh_roots.pop(victim, None)
                if parent is not None and parent in inner:  # the parent is a leaf now: _to_leaf, inlined
                    del inner[parent]
                    record = meta_of[parent]
                    then, record[2] = record[2], -1
                    if parent in chain_detached:
                        lane_detached[parent] = then
                    else:
                        if fronts is not None and parent not in pinned:  # its class's front, if older
                            front = fronts[record[0]]
                            if front is not _STALE and (front is None or then < front[1]):
                                fronts[record[0]] = (parent, then)
                        queue = queues[record[0]]
                        if not queue or then >= queue[next(reversed(queue))]:
                            queue[parent] = then
                        elif then <= queue[next(iter(queue))]:  # the usual case: older than its successors
                            queue[parent] = then
                            queue.move_to_end(parent, last=False)
                        else:
                            late[record[0]][parent] = then
                            heappush(late_heaps[record[0]], (then, parent))
                    since = members.get(parent)  # ProbationLane.became_leaf
                    if since is not None:
                        heappush(heap, (-since, parent))
            i += 1
            # --- insert(key, hints[i]), inlined (keys are new)
            hint_pred = hints[i - 1].predecessor
            h = crc32(*key)
            t = self._clock = self._clock + 1
            entry = table[h & slot_mask]
            if entry and (entry >> 4) & 0xFFFF == h >> 16 and t - (entry >> 20) <= reach:
                old = entry & 15
                cls = old + 1 if old < top and t - (entry >> 20) <= repeat_within else old
                if not h >> _SAMPLE_SHIFT:
                    hist[old][_bin(t - (entry >> 20))] += 1.0
                    refs[cls] += 1.0
            else:
                cls = 0
                if not h >> _SAMPLE_SHIFT:
                    refs[0] += 1.0
            record = meta_of[key] = [cls, h, -1]
            queue = queues[cls]
            queue[key] = t
            if t >= next_refit:
                fronts = None
                self._refit()
                table, slot_mask, reach = self._table, self._slot_mask, self._reach
                repeat_within, hist, refs = self._repeat_within, self._hist, self._refs
                next_refit, weights, learned = self._next_refit, self.weights, self._learned
            if hint_pred is not None and hint_pred != key:  # ChainForest.link, inlined
                pred_of[key] = hint_pred
                siblings = children.get(hint_pred)
                if siblings is None:
                    children[hint_pred] = [key]
                    if hint_pred in meta_of and hint_pred not in inner:  # a leaf parent: inner now
                        inner[hint_pred] = None
                        parent_record = meta_of[hint_pred]
                        if hint_pred not in pinned:
                            if fronts is not None:  # it may be its class's front
                                fronts[parent_record[0]] = _STALE
                            if inner_by_age.heap is not None:
                                inner_by_age = _InnerByAge(inner, meta_of, pinned)
                        then = queues[parent_record[0]].pop(hint_pred, -1)
                        parent_record[2] = then if then >= 0 else self._from_leaf(hint_pred)
                else:
                    siblings.append(key)
                if hint_pred in chain_detached:
                    chain_detached.add(key)
            leaf = True
            if key in children:
                fronts = None
                is_inner, attached, newly_detached = chains.adopt(key, hint_pred, meta_of)
                for k in attached:
                    then = lane_detached.pop(k, -1)
                    if then >= 0:
                        to_leaf(k, then)
                for k in newly_detached:
                    if k not in inner:
                        lane_detached[k] = self._from_leaf(k)
                if is_inner:
                    inner[key] = None
                    record[2] = queue.pop(key)
                    leaf = False
            if leaf and key in chain_detached:
                lane_detached[key] = queue.pop(key)
            # --- ProbationLane.stored(key, hint_pred, t, leaf), inlined; the leaf's heap entry deferred
            if hint_pred is None or hint_pred == key:
                fresh_roots[key] = t
                continue
            if hint_pred not in members:
                since = fresh_roots.pop(hint_pred, None)
                if since is None:
                    continue  # after a hit or protected block: the chain is protected
                members[hint_pred] = since  # a fresh head with a successor: a chain on probation
            members[key] = t
            if leaf:
                if pending is not None and pending[1] not in inner:
                    heappush(heap, pending)  # (an inner key's entry would be stale: became_leaf re-adds it)
                pending = (-t, key)
        if pending is not None:
            heappush(heap, pending)
        return len(keys), out

    def _store_unlinked(self, keys: Sequence[BlockKey], hints: Sequence[InsertHint],
                        pinned: Container[BlockKey], free: int) -> tuple[int, list[BlockKey]] | None:
        """:meth:`store_new` of keys without chain links while recency alone decides (nothing learned,
        no late, detached or probation leaf, no refit due within the batch, victims unlinked): then each
        victim is the oldest unpinned queued leaf left, so all are chosen at once, and the per-key loop
        only removes and inserts (a cache fed without hints, as the CPU-tier benchmark; the loop below
        cost ~35 Python lines per key more). None, having changed nothing, in every other case.
        """
        n = len(keys)
        if (self._learned or self._detached or self.probation.members or any(self._late)
                or self._clock + n >= self._next_refit or list(map(_predecessor, hints)).count(None) != n):
            return None
        chains = self.chains
        if not (chains.children.keys().isdisjoint(keys) and chains.detached.isdisjoint(keys)):
            return None
        queues = self._queues
        count = n - free
        victims: list[tuple[BlockKey, int]] = []
        if count > 0:
            heads = [list(islice(queue.items(), count)) for queue in queues if queue]
            victims = heads[0] if len(heads) == 1 else sorted(chain(*heads), key=_second)[:count]
            if len(victims) < count:
                return None  # too few leaves: the loop below finds what else may go
            taken = [key for key, _ in victims]
            if (any(map(pinned.__contains__, taken)) or not chains.pred.keys().isdisjoint(taken)
                    or not chains.children.keys().isdisjoint(taken) or not chains.detached.isdisjoint(taken)):
                return None
        meta_of, table, slot_mask, class_of_new = self._meta, self._table, self._slot_mask, self._class_of_new
        fresh_roots = self.probation.fresh_roots
        t = self._clock
        for j, key in enumerate(keys):
            if j >= free:  # remove(victim), inlined: a queued leaf with no links, not on probation
                victim, then = victims[j - free]
                cls, h, _ = meta_of.pop(victim)
                del queues[cls][victim]
                table[h & slot_mask] = (then << 20) | ((h >> 16) << 4) | cls
                fresh_roots.pop(victim, None)
            # insert(key), inlined but for the class: a key without a predecessor
            h = crc32(*key)
            t += 1
            cls = class_of_new(h, t)
            meta_of[key] = [cls, h, -1]
            queues[cls][key] = t
            fresh_roots[key] = t
        self._clock = t
        return n, [key for key, _ in victims]

    def _class_of_new(self, h: int, t: int) -> int:
        """The class of a key of hash ``h`` inserted at ``t`` (its ghost's, one up if it came back soon;
        0 without one), counting the sampled reference: the lifetime policy's insert, which
        :meth:`store_new` inlines."""
        entry = self._table[h & self._slot_mask]
        if entry and (entry >> 4) & 0xFFFF == h >> 16 and t - (entry >> 20) <= self._reach:
            old = entry & 15
            cls = old + 1 if old < self._top and t - (entry >> 20) <= self._repeat_within else old
            if not h >> _SAMPLE_SHIFT:
                self._hist[old][_bin(t - (entry >> 20))] += 1.0
                self._refs[cls] += 1.0
            return cls
        if not h >> _SAMPLE_SHIFT:
            self._refs[0] += 1.0
        return 0

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        out: list[BlockKey] = []
        if count <= 0:
            return out
        if not self._detached and self.probation.applies(len(self._meta)):
            out, skip = self.probation.take(count, pinned, self._inner)
            if len(out) == count:
                return out
            if out:
                out.extend(self._victims(count - len(out), skip))
                return out
        return self._victims(count, pinned)

    def _victims(self, count: int, pinned: Container[BlockKey],
                 inner_by_age: _InnerByAge | None = None) -> list[BlockKey]:
        """:meth:`victims` by the leader expert's order (detached leaves first); ``inner_by_age``: the
        unpinned inner keys by age, kept across a :meth:`store_new` batch."""
        out: list[BlockKey] = []
        if count == 1 and not self._detached:  # the common case, inlined
            now, weights, learned = self._clock + 1, self.weights, self._learned
            best: BlockKey | None = None
            best_score = -1.0
            for c, queue in enumerate(self._queues):
                key = None
                for key, t in queue.items():  # noqa: B007 - t is the front's time, used below
                    if key not in pinned:
                        break
                else:
                    key = None
                late = self._late[c]
                if late:
                    heap = self._late_heap[c]
                    while heap and late.get(heap[0][1]) != heap[0][0]:
                        heapq.heappop(heap)  # stale: forgetting it changes no order
                    if heap and (key is None or heap[0][0] < t):
                        if heap[0][1] in pinned:
                            break  # rare: the careful walk below
                        t, key = heap[0]
                if key is None:
                    continue
                if learned:
                    if weights[c] == _NEVER_KEEP:
                        return [key]
                    score = (now - t) * weights[c]
                else:
                    score = now - t
                if score > best_score:
                    best, best_score = key, score
            else:
                if best is not None:
                    return [best]
        if self._detached:
            if count == 1:  # the oldest unpinned one: what the sorted walk below takes, in one pass
                oldest = _oldest_unpinned(self._detached.items(), pinned)
                if oldest is not None:
                    return [oldest]
            elif take_unpinned(sorted(self._detached, key=self._detached.__getitem__), pinned, count, out):
                return out
        skip: Container[BlockKey] = pinned
        while len(out) < count:
            fronts = self._fronts(skip)
            if not fronts:
                break
            victim = max(fronts, key=self._overstay) if self._learned else min(fronts, key=_last_reference)
            out.append(victim[1])
            if len(out) < count:
                skip = Excluding(pinned, out)
        if len(out) < count and self._inner:  # every leaf is pinned: inner blocks, least recently used first
            meta = self._meta
            if count == 1:
                if inner_by_age is not None:
                    oldest = inner_by_age.oldest()
                else:
                    oldest = _oldest_unpinned(((k, meta[k][2]) for k in self._inner), pinned)
                if oldest is not None:
                    out.append(oldest)
            else:
                take_unpinned(sorted(self._inner, key=lambda k: meta[k][2]), pinned, count, out)
        return out

    def _overstay(self, front: tuple[int, BlockKey, int]) -> float:
        weight = self.weights[front[0]]
        return float("inf") if weight == _NEVER_KEEP else (self._clock + 1 - front[2]) * weight

    def _fronts(self, skip: Container[BlockKey]) -> list[tuple[int, BlockKey, int]]:
        """(class, key, last reference) of the oldest leaf of each class not in ``skip``."""
        fronts = []
        for c, queue in enumerate(self._queues):
            best: tuple[int, BlockKey, int] | None = None
            for key, t in queue.items():
                if key not in skip:
                    best = (c, key, t)
                    break
            late, heap = self._late[c], self._late_heap[c]
            if late:
                while heap and late.get(heap[0][1]) != heap[0][0]:
                    heapq.heappop(heap)  # stale: forgetting it changes no order
                for t, key in heapq.nsmallest(len(heap), heap) if heap[0][1] in skip else heap[:1]:
                    if key not in skip and late.get(key) == t:
                        if best is None or t < best[2]:
                            best = (c, key, t)
                        break
            elif heap:
                heap.clear()
            if best is not None:
                fronts.append(best)
        return fronts


class _InnerByAge:
    """The unpinned inner keys, least recently used first, for the every-leaf-pinned fallback across
    one :meth:`AdaptiveChainPolicy.store_new` batch: rescanning every inner block per victim was a
    fifth of the default's cost at 1 % on long agentic sessions. Valid while no unpinned key turns
    inner (the batch makes a new one then): a key that leaves ``inner`` or is evicted is skipped, as
    no inner key's time changes within a batch."""

    __slots__ = ("inner", "meta", "pinned", "heap")

    def __init__(self, inner: dict[BlockKey, None], meta: dict[BlockKey, list[int]],
                 pinned: Container[BlockKey]) -> None:
        self.inner, self.meta, self.pinned = inner, meta, pinned
        self.heap: list[tuple[int, BlockKey]] | None = None  # built when first asked

    def oldest(self) -> BlockKey | None:
        """What ``_oldest_unpinned`` over the inner keys and their times returns now."""
        heap, meta = self.heap, self.meta
        if heap is None:
            pinned = self.pinned
            heap = self.heap = [(meta[k][2], k) for k in self.inner if k not in pinned]  # distinct times
            heapq.heapify(heap)
        while heap:
            t, key = heap[0]
            record = meta.get(key)
            if record is not None and record[2] == t:  # still resident and inner (a leaf's is -1)
                return key
            heapq.heappop(heap)
        return None


def _oldest_unpinned(timed: Iterable[tuple[BlockKey, int]], pinned: Container[BlockKey]) -> BlockKey | None:
    """The key of least time among ``(key, last reference)`` pairs not in ``pinned`` (times are distinct)."""
    best: BlockKey | None = None
    best_t = 0
    for key, t in timed:
        if (best is None or t < best_t) and key not in pinned:
            best, best_t = key, t
    return best
