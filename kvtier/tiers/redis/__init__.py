"""The Redis tier (one server or a Redis Cluster), split by concern; docs/redis.md describes its use.

- ``tier``: :class:`RedisTier` — routing a batch to nodes, redirections, breakers, counters.
- ``requests``: one request per block and the I/O threads that run a node's share of a batch.
- ``protocol``: RESP2 over blocking sockets, the per-node connection pool, opening a connection.
- ``breaker``: :class:`CircuitBreaker` and its one settings model, :class:`CircuitBreakerConfig`.
- ``cluster``: the slot map and SCAN, through redis-py (imported only when used).
"""

from kvtier.tiers.redis.breaker import CircuitBreaker, CircuitBreakerConfig
from kvtier.tiers.redis.tier import DEFAULT_URL, KEY_PREFIX, Compression, RedisTier

__all__ = ["DEFAULT_URL", "KEY_PREFIX", "CircuitBreaker", "CircuitBreakerConfig", "Compression", "RedisTier"]
