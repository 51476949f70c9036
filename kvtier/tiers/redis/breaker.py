"""A per-node circuit breaker, so a dead Redis node costs nothing per batch until it may be back.

Its settings are the one ``CircuitBreakerConfig``: the YAML key ``circuit_breaker`` of a redis tier
is validated by this model (through ``kvtier.config``), and the tier receives the validated object.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field


class CircuitBreakerConfig(BaseModel):
    """After ``failures`` consecutive failed attempts, answer at once for ``cooldown_seconds``.

    ``cooldown_seconds: 0`` keeps counting failures but lets the very next batch probe the node:
    the breaker then never skips a request (useful to test a flaky node, or to turn it off).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    failures: int = Field(default=5, gt=0, strict=True)
    cooldown_seconds: float = Field(default=5.0, ge=0, strict=True)


class CircuitBreaker:
    """Closed → open after N consecutive failures → one probe after the cool-down → closed or open.

    Not thread-safe: the tier uses it from its event loop only. ``clock`` is injectable for tests.
    """

    def __init__(self, config: CircuitBreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        """True from the opening failure until a successful probe."""
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether to try now; after the cool-down the first caller becomes the (only) probe."""
        if self._open_until is None:
            return True
        if self._probing or self._clock() < self._open_until:
            return False
        self._probing = True
        return True

    def success(self) -> bool:
        """Record a request that completed; returns True when this closed an open breaker."""
        was_open = self._open_until is not None
        self.consecutive_failures = 0
        self._open_until = None
        self._probing = False
        return was_open

    def failure(self) -> bool:
        """Record a failed attempt; returns True when this opened a closed breaker."""
        self.consecutive_failures += 1
        if self._probing or self.consecutive_failures >= self.config.failures:
            opened = self._open_until is None
            self._open_until = self._clock() + self.config.cooldown_seconds
            self._probing = False
            return opened
        return False

    def end_attempt(self) -> None:
        """Called after every allowed attempt: a probe that recorded nothing lets the next caller probe."""
        self._probing = False
