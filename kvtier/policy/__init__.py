"""Decisions, never bytes: eviction per tier partition and placement across tiers.

``make_eviction_policy(name)`` is the one factory the cache, the config and ``kvtier replay`` use.
Belady's MIN (:mod:`kvtier.policy.belady`) needs the future, so only the replay harness builds it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.policy.adaptive import AdaptiveChainPolicy
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy, InsertHint
from kvtier.policy.chains import LeafLRUPolicy
from kvtier.policy.lifetime import LearnedLifetimePolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixAwarePolicy
from kvtier.policy.probation import LeafProbationPolicy
from kvtier.policy.sieve import SievePolicy
from kvtier.policy.tinylfu import WTinyLFUPolicy

#: Eviction policies by config name. New policies register here.
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "sieve": SievePolicy,
    "tinylfu": WTinyLFUPolicy,
    "prefix": PrefixAwarePolicy,
    "lifetime": LearnedLifetimePolicy,
    "leaf_lru": LeafLRUPolicy,
    "leaf_probation": LeafProbationPolicy,
    "adaptive": AdaptiveChainPolicy,
}

#: The policy used when a tier's config names none.
DEFAULT_EVICTION = "adaptive"


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy object for one partition; raises ``KeyError`` naming the known policies.

    ``default`` names :data:`DEFAULT_EVICTION`.
    """
    if name == "default":
        name = DEFAULT_EVICTION
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None
    return factory()


__all__ = ["DEFAULT_EVICTION", "EVICTION_POLICIES", "ARCPolicy", "AdaptiveChainPolicy", "EvictionPolicy",
           "InsertHint", "LRUPolicy", "LeafLRUPolicy", "LeafProbationPolicy", "LearnedLifetimePolicy",
           "PrefixAwarePolicy", "SievePolicy", "WTinyLFUPolicy", "make_eviction_policy"]
