"""Admission: whether a tier lets a block in at all (CacheLib's ``admission_policy/``).

Admitting every block to a slow tier wastes write bandwidth on blocks that are never read again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

from kvtier.blocks import BlockKey
from kvtier.policy.tinylfu import CountMinSketch, key_hash


class AdmissionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def admit(self, key: BlockKey) -> bool:
        """Whether ``key`` may enter the tier now; may record that it was seen."""


class AdmitAll(AdmissionPolicy):
    """Every block is admitted: the right choice for the top tier."""

    name = "always"

    def admit(self, key: BlockKey) -> bool:
        return True


class SecondSighting(AdmissionPolicy):
    """Admit a block only the second time it is offered within a bounded history.

    One-hit wonders (blocks written once and never reused) never cost a write to this tier. The
    history holds at most ``history`` keys, oldest forgotten first, so memory is bounded.
    """

    name = "second_sighting"

    def __init__(self, history: int = 65536) -> None:
        if history <= 0:
            raise ValueError(f"history must be positive, got {history}")
        self.history = history
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()

    def admit(self, key: BlockKey) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self.history:
            self._seen.popitem(last=False)
        return False


class TinyLFUAdmission(AdmissionPolicy):
    """Admit a block once a count-min sketch has seen it ``min_count`` times within its horizon.

    The TinyLFU filter as a tier's doorkeeper: like :class:`SecondSighting` but in a fixed
    ``2 × 4 × history`` bytes instead of a key per entry, and with history that fades (counters
    halve every ``history`` offers) instead of being cut off. Estimates never run low, so a block
    offered ``min_count`` times is always admitted; a hash collision may admit one sooner.
    """

    name = "tinylfu"

    def __init__(self, history: int = 65536, min_count: int = 2) -> None:
        if history <= 0:
            raise ValueError(f"history must be positive, got {history}")
        if not 1 <= min_count <= 15:
            raise ValueError(f"min_count must be in 1..15, got {min_count}")
        self.history = history
        self.min_count = min_count
        self._sketch = CountMinSketch(history)

    def admit(self, key: BlockKey) -> bool:
        return self._sketch.increment(key_hash(key)) >= self.min_count


#: Admission policies by config name.
ADMISSION_POLICIES = ("always", "second_sighting", "tinylfu")


def make_admission_policy(name: str, history: int = 65536) -> AdmissionPolicy:
    if name == "always":
        return AdmitAll()
    if name == "second_sighting":
        return SecondSighting(history)
    if name == "tinylfu":
        return TinyLFUAdmission(history)
    raise KeyError(f"unknown admission policy {name!r}; known: {list(ADMISSION_POLICIES)}")
