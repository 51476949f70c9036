"""Decisions, never bytes: eviction per tier partition and placement across tiers.

``make_eviction_policy(name)`` is the one factory the cache, the config and ``kvtier replay`` use.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.policy.base import EvictionPolicy, InsertHint
from kvtier.policy.lru import LRUPolicy

#: Eviction policies by config name. New policies register here.
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}

#: The policy used when a tier's config names none.
DEFAULT_EVICTION = "lru"


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy object for one partition; raises ``KeyError`` naming the known policies."""
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None
    return factory()


__all__ = ["DEFAULT_EVICTION", "EVICTION_POLICIES", "EvictionPolicy", "InsertHint", "LRUPolicy",
           "make_eviction_policy"]
