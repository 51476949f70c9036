"""Brute-force reference models of the eviction policies, for the property tests.

Each keeps its state in plain lists and recomputes the eviction order from scratch (or simulates the
eviction on a copy), so it is obviously right and obviously slow. Same lifecycle as
:class:`kvtier.policy.base.EvictionPolicy`: insert, access, remove, victims(count, pinned).
"""

from __future__ import annotations

import copy
from collections.abc import Container
from typing import Any

from kvtier.blocks import BlockKey
from kvtier.policy.base import InsertHint


class RefLRU:
    def __init__(self) -> None:
        self.order: list[BlockKey] = []

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        self.access(key) if key in self.order else self.order.append(key)

    def access(self, key: BlockKey) -> None:
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    def remove(self, key: BlockKey) -> None:
        if key in self.order:
            self.order.remove(key)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        return [k for k in self.order if k not in pinned][:max(count, 0)]


class RefARC:
    """Textbook lists; adapts ``p`` when a ghost key is inserted (as kvtier's ARC does)."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list[BlockKey] = []
        self.t2: list[BlockKey] = []
        self.b1: list[BlockKey] = []
        self.b2: list[BlockKey] = []

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self.b2.remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
        self._trim()

    def access(self, key: BlockKey) -> None:
        if key in self.t1:
            self.t1.remove(key)
            self.t2.append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.t2.append(key)

    def remove(self, key: BlockKey) -> None:
        if key in self.t1:
            self.t1.remove(key)
            self.b1.append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.b2.append(key)
        else:
            return
        self._trim()

    def _trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.pop(0)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.pop(0)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        t1 = [k for k in self.t1 if k not in pinned]
        t2 = [k for k in self.t2 if k not in pinned]
        n1, out = len(self.t1), []
        while len(out) < count and (t1 or t2):
            if t1 and (not t2 or n1 > self.p):
                out.append(t1.pop(0))
                n1 -= 1
            else:
                out.append(t2.pop(0))
        return out


class RefSieve:
    """SIEVE on a Python list (oldest first); victims simulate the walk on a copy."""

    def __init__(self) -> None:
        self.queue: list[BlockKey] = []
        self.visited: dict[BlockKey, bool] = {}
        self.hand: BlockKey | None = None
        self._after: dict[BlockKey, dict[str, Any]] = {}  # victim -> state after evicting it

    def _state(self) -> dict[str, Any]:
        return {"queue": list(self.queue), "visited": dict(self.visited), "hand": self.hand}

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self.visited:
            self.access(key)
            return
        self._after.clear()
        self.queue.append(key)
        self.visited[key] = False

    def access(self, key: BlockKey) -> None:
        if key in self.visited:
            self._after.clear()
            self.visited[key] = True

    @staticmethod
    def _drop(state: dict[str, Any], key: BlockKey) -> None:
        queue = state["queue"]
        i = queue.index(key)
        if state["hand"] == key:
            state["hand"] = queue[i + 1] if i + 1 < len(queue) else None
        queue.pop(i)
        del state["visited"][key]

    def remove(self, key: BlockKey) -> None:
        if key not in self.visited:
            return
        after = self._after.pop(key, None) if self._after and next(iter(self._after)) == key else None
        if after is None:
            self._after.clear()
            state = self._state()
            self._drop(state, key)
        else:
            state = after
        self.queue, self.visited, self.hand = state["queue"], state["visited"], state["hand"]

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        self._after.clear()
        state = self._state()
        out: list[BlockKey] = []
        while len(out) < count:
            queue, visited = state["queue"], state["visited"]
            candidates = [k for k in queue if k not in pinned]
            if not candidates:
                break
            i = queue.index(state["hand"]) if state["hand"] is not None else 0
            for _ in range(2 * len(queue) + 1):
                key = queue[i]
                if key not in pinned:
                    if not visited[key]:
                        break
                    visited[key] = False
                i = (i + 1) % len(queue)
            out.append(key)
            state["hand"] = queue[i + 1] if i + 1 < len(queue) else None
            state["queue"] = queue[:i] + queue[i + 1:]
            del visited[key]
            self._after[key] = copy.deepcopy(state)
        return out


class RefPrefix:
    """Sort every resident key by (epoch of last reference, -position, age) each time."""

    def __init__(self, capacity: int, epochs: int = 8) -> None:
        self.length = max(1, capacity // epochs)
        self.epoch, self.left, self.seq = 0, self.length, 0
        self.meta: dict[BlockKey, tuple[int, int, int]] = {}

    def _touch(self, key: BlockKey, position: int) -> None:
        self.left -= 1
        if self.left <= 0:
            self.epoch, self.left = self.epoch + 1, self.length
        self.seq += 1
        self.meta[key] = (self.epoch, position, self.seq)

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        self._touch(key, self.meta[key][1] if key in self.meta else hint.position)

    def access(self, key: BlockKey) -> None:
        if key in self.meta:
            self._touch(key, self.meta[key][1])

    def remove(self, key: BlockKey) -> None:
        self.meta.pop(key, None)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        order = sorted(self.meta, key=lambda k: (self.meta[k][0], -self.meta[k][1], self.meta[k][2]))
        return [k for k in order if k not in pinned][:max(count, 0)]


class RefTinyLFU:
    """W-TinyLFU with exact counts (capped at 15, halved every ``horizon`` increments) and lists."""

    def __init__(self, capacity: int, window: float = 0.01, protected: float = 0.8,
                 sample_factor: int = 10) -> None:
        self.window_max = max(1, round(capacity * window))
        self.protected_max = int((capacity - self.window_max) * protected)
        self.horizon = max(1024, sample_factor * capacity)
        self.counts: dict[BlockKey, int] = {}
        self.additions = 0
        self.window: list[BlockKey] = []
        self.probation: list[BlockKey] = []
        self.protected: list[BlockKey] = []

    def _count(self, key: BlockKey) -> None:
        self.counts[key] = min(15, self.counts.get(key, 0) + 1)
        self.additions += 1
        if self.additions >= self.horizon:
            self.counts = {k: v >> 1 for k, v in self.counts.items()}
            self.additions //= 2

    def _resident(self) -> list[BlockKey]:
        return self.window + self.probation + self.protected

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self._resident():
            self.access(key)
            return
        self._count(key)
        self.window.append(key)
        if len(self.window) > self.window_max:
            self.probation.append(self.window.pop(0))
        while len(self.protected) > self.protected_max:
            self.probation.append(self.protected.pop(0))

    def access(self, key: BlockKey) -> None:
        if key not in self._resident():
            return
        self._count(key)
        if key in self.window:
            self.window.remove(key)
            self.window.append(key)
        elif key in self.probation:
            self.probation.remove(key)
            self.protected.append(key)
            if len(self.protected) > self.protected_max:
                self.probation.append(self.protected.pop(0))
        else:
            self.protected.remove(key)
            self.protected.append(key)

    def remove(self, key: BlockKey) -> None:
        for area in (self.window, self.probation, self.protected):
            if key in area:
                area.remove(key)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        window = [k for k in self.window if k not in pinned]
        main = [k for k in self.probation + self.protected if k not in pinned]
        contests = max(0, len(self.window) + count - self.window_max)
        out: list[BlockKey] = []
        while len(out) < count and ((window and contests) or main):
            if window and contests and (not main
                                        or self.counts.get(window[0], 0) <= self.counts.get(main[0], 0)):
                out.append(window.pop(0))
                contests -= 1
            else:
                out.append(main.pop(0))
        for key in window:
            if len(out) == count:
                break
            out.append(key)
        return out


class RefLeafLRU:
    """Leaf-first LRU by definition, recomputed from scratch on every question.

    A resident key is *orphaned* while its declared predecessor, resident when the key was (or
    became) linked to it, is gone; it is *detached* if it or any resident ancestor is orphaned.
    Order: detached leaves, attached leaves, inner keys (a resident key declares it), each oldest
    first; pinned keys never.
    """

    def __init__(self) -> None:
        self.clock = 0
        self.time: dict[BlockKey, int] = {}
        self.pred: dict[BlockKey, BlockKey] = {}
        self.orphaned: set[BlockKey] = set()

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self.time:
            self.access(key)
            return
        self.clock += 1
        self.time[key] = self.clock
        if hint.predecessor is not None and hint.predecessor != key:
            self.pred[key] = hint.predecessor
        self.orphaned -= {k for k in self.time if self.pred.get(k) == key}

    def access(self, key: BlockKey) -> None:
        if key in self.time:
            self.clock += 1
            self.time[key] = self.clock

    def remove(self, key: BlockKey) -> None:
        if key not in self.time:
            return
        del self.time[key]
        self.pred.pop(key, None)
        self.orphaned.discard(key)
        self.orphaned |= {k for k in self.time if self.pred.get(k) == key}

    def detached(self, key: BlockKey) -> bool:
        seen = set()
        while key in self.time and key not in seen:
            if key in self.orphaned:
                return True
            seen.add(key)
            key = self.pred.get(key)  # type: ignore[assignment]
        return False

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        inner = {p for k, p in self.pred.items() if k in self.time}

        def rank(key: BlockKey) -> tuple[int, int]:
            lane = 2 if key in inner else (0 if self.detached(key) else 1)
            return lane, self.time[key]

        return sorted((k for k in self.time if k not in pinned), key=rank)[:max(count, 0)]


class RefLeafProbation(RefLeafLRU):
    """Leaf-first LRU with the probation lane, by definition (:mod:`kvtier.policy.probation`).

    A key stored with no predecessor is a fresh head until it is hit or gets a successor; a key
    stored after a fresh head or a probation key is on probation (and so is that head) until hit.
    While no detached leaf is resident and the keys off probation are at most 30 % of the resident
    ones, probation leaves go first, the most recently stored first; then leaf-first LRU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fresh: dict[BlockKey, int] = {}
        self.probation: dict[BlockKey, int] = {}

    def insert(self, key: BlockKey, hint: InsertHint = InsertHint()) -> None:
        if key in self.time:
            self.access(key)
            return
        super().insert(key, hint)
        pred = hint.predecessor
        if pred is None or pred == key:
            self.fresh[key] = self.clock
        elif pred in self.probation:
            self.probation[key] = self.clock
        elif pred in self.fresh:
            self.probation[pred] = self.fresh.pop(pred)
            self.probation[key] = self.clock

    def access(self, key: BlockKey) -> None:
        if key in self.time:
            self.fresh.pop(key, None)
            self.probation.pop(key, None)
        super().access(key)

    def remove(self, key: BlockKey) -> None:
        self.fresh.pop(key, None)
        self.probation.pop(key, None)
        super().remove(key)

    def victims(self, count: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        inner = {p for k, p in self.pred.items() if k in self.time}
        detached_leaf = any(self.detached(k) for k in self.time if k not in inner)
        resident = len(self.time)
        if detached_leaf or not self.probation or resident - len(self.probation) > 0.3 * resident:
            return super().victims(count, pinned)
        lane = sorted((k for k in self.probation if k not in inner and k not in pinned),
                      key=lambda k: -self.probation[k])[:max(count, 0)]
        rest = super().victims(count - len(lane), set(lane) | {k for k in self.time if k in pinned})
        return lane + rest
