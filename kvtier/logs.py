"""Rate-limited warnings: a fault that hits thousands of blocks must not write thousands of log lines.

:class:`LogLimiter` lets the first ``burst`` lines of an ``interval`` through and then keeps count;
the next line after the interval (or :meth:`LogLimiter.flush`, which tiers call on close) says how
many were suppressed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: Lines let through per interval before the limiter only counts.
DEFAULT_BURST = 5
#: Seconds of one interval.
DEFAULT_INTERVAL = 60.0


class LogLimiter:
    """Thread-safe: at most ``burst`` lines per ``interval`` seconds, then one summary line with a count."""

    def __init__(self, logger: logging.Logger, what: str, *, burst: int = DEFAULT_BURST,
                 interval: float = DEFAULT_INTERVAL, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or interval <= 0:
            raise ValueError(f"burst must be ≥ 1 and interval > 0, got {burst} and {interval}")
        self.logger = logger
        self.what = what
        self.burst = burst
        self.interval = interval
        self.level = level
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._emitted = 0
        self._suppressed = 0
        #: lines suppressed since this limiter was made (for tests and stats)
        self.total_suppressed = 0

    def log(self, message: str, *args: object) -> None:
        """Log ``message % args`` unless this interval's burst is spent (then only count it)."""
        now = self._clock()
        with self._lock:
            summary = self._roll(now)
            emit = self._emitted < self.burst
            if emit:
                self._emitted += 1
            else:
                self._suppressed += 1
                self.total_suppressed += 1
            last = emit and self._emitted == self.burst
        if summary:
            self.logger.log(self.level, "%s", summary)
        if emit:
            if last:
                message += " (further %s are counted, not logged, for %.0f s)"
                args = (*args, self.what, self.interval)
            self.logger.log(self.level, message, *args)

    def flush(self) -> None:
        """Log the summary of a window with suppressed lines now (say, when the tier closes)."""
        with self._lock:
            summary = self._summary(self._clock())
            self._window_start, self._emitted, self._suppressed = None, 0, 0
        if summary:
            self.logger.log(self.level, "%s", summary)

    def _roll(self, now: float) -> str | None:
        """Start a new window when the current one is over; return the old one's summary (lock held)."""
        if self._window_start is not None and now - self._window_start < self.interval:
            return None
        summary = self._summary(now) if self._window_start is not None else None
        self._window_start, self._emitted, self._suppressed = now, 0, 0
        return summary

    def _summary(self, now: float) -> str | None:
        if not self._suppressed or self._window_start is None:
            return None
        return (f"{self._suppressed} more {self.what} in the last {now - self._window_start:.0f} s "
                "(not logged one by one)")
