"""The Redis tier (one server or a Redis Cluster), split by concern; docs/redis.md describes its use.

- ``tier``: :class:`RedisTier` — routing a batch to nodes, redirections, breakers, counters.
- ``requests``: one request per block and the I/O threads that run a node's share of a batch.
- ``protocol``: RESP2 over blocking sockets, the per-node connection pool, opening a connection.
- ``breaker``: :class:`CircuitBreaker` and its one settings model, :class:`CircuitBreakerConfig`.
- ``cluster``: the slot map and SCAN, through redis-py (imported only when used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.tiers.redis.breaker import CircuitBreaker, CircuitBreakerConfig

if TYPE_CHECKING:
    from kvtier.tiers.redis.tier import DEFAULT_URL, KEY_PREFIX, Compression, RedisTier

_FROM_TIER = ("DEFAULT_URL", "KEY_PREFIX", "Compression", "RedisTier")


def __getattr__(name: str) -> Any:
    """The tier (and torch with it) loads on first use: validating a config needs only the breaker."""
    if name in _FROM_TIER:
        from kvtier.tiers.redis import tier

        return getattr(tier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_URL", "KEY_PREFIX", "CircuitBreaker", "CircuitBreakerConfig", "Compression", "RedisTier"]
