"""Synthetic request traces the policy tests replay: loops, scans, Zipf, shifting sets, multi-turn chat.

Each generator returns a :class:`kvtier.traces.Trace` built in memory (no file), deterministic for
a seed. Single-block requests make block hits and prefix hits the same thing (classic cache
workloads); the chat generator makes real chains (system prompt, growing conversations, think time).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random

from kvtier.blocks import BlockKey
from kvtier.traces import Trace

BLOCK_TOKENS = 16


def _trace(name: str, chains: list[list[int]], tokens: list[int] | None = None) -> Trace:
    keys: dict[int, BlockKey] = {}
    requests = [[keys.setdefault(i, BlockKey(i.to_bytes(8, "little"), 0)) for i in chain] for chain in chains]
    if tokens is None:
        tokens = [len(chain) * BLOCK_TOKENS for chain in chains]
    return Trace(name=name, format="synthetic", block_tokens=BLOCK_TOKENS, requests=requests, tokens=tokens,
                 distinct_blocks=len(keys))


def loop(n_keys: int, refs: int) -> Trace:
    """Keys 0..n-1 over and over: LRU's worst case when n exceeds the capacity."""
    return _trace(f"loop{n_keys}", [[i % n_keys] for i in range(refs)])


def zipf(n_keys: int, refs: int, alpha: float, seed: int = 0) -> Trace:
    """Independent references, key of rank r drawn with probability proportional to r^-alpha."""
    rnd = random.Random(seed)
    cumulative = list(itertools.accumulate(1.0 / (r + 1) ** alpha for r in range(n_keys)))
    ids = list(range(n_keys))
    rnd.shuffle(ids)
    total = cumulative[-1]
    return _trace(f"zipf{alpha}", [[ids[bisect.bisect_left(cumulative, rnd.random() * total)]]
                                   for _ in range(refs)])


def scan_hot(hot: int, refs: int, scan_length: int, scan_every: int, seed: int = 0) -> Trace:
    """Uniform references to a hot set, interrupted by scans of keys never seen again."""
    rnd = random.Random(seed)
    chains: list[list[int]] = []
    fresh = itertools.count(1 << 40)
    while len(chains) < refs:
        chains.extend([rnd.randrange(hot)] for _ in range(scan_every))
        chains.extend([next(fresh)] for _ in range(scan_length))
    return _trace("scan+hot", chains[:refs])


def shifting(working_set: int, refs: int, phase: int, seed: int = 0) -> Trace:
    """Uniform references to a working set that is replaced every ``phase`` references."""
    rnd = random.Random(seed)
    return _trace("shifting",
                  [[(i // phase) * working_set + rnd.randrange(working_set)] for i in range(refs)])


def chat(refs: int, seed: int = 0, *, p_continue: float = 0.6, think: tuple[int, int] = (50, 400),
         system_blocks: int = 4, turn_tokens: tuple[int, int] = (50, 800)) -> Trace:
    """Multi-turn chat: every conversation starts with a shared system prompt; a turn re-sends the
    whole conversation plus new tokens (the last, partial block changes), and comes back after a
    think time of ``think`` requests with probability ``p_continue``."""
    rnd = random.Random(seed)
    fresh = itertools.count(1000)
    system = [next(fresh) for _ in range(system_blocks)]
    waiting: list[tuple[int, float, list[int], int]] = []  # (due request, tie-break, blocks, tokens)
    chains: list[list[int]] = []
    tokens: list[int] = []
    total = 0
    while total < refs:
        r = len(chains)
        if waiting and waiting[0][0] <= r:
            _, _, blocks, count = heapq.heappop(waiting)
        else:
            blocks, count = list(system), system_blocks * BLOCK_TOKENS
        blocks = blocks[:count // BLOCK_TOKENS]
        count += rnd.randint(*turn_tokens)
        while len(blocks) * BLOCK_TOKENS < count:
            blocks.append(next(fresh))
        chains.append(blocks)
        tokens.append(count)
        total += len(blocks)
        if rnd.random() < p_continue:
            heapq.heappush(waiting,
                           (r + rnd.randint(*think), rnd.random(), blocks, count + rnd.randint(20, 400)))
    return _trace("chat", chains, tokens)


def sessions(refs: int, seed: int = 0, *, users: int = 8, new_blocks: tuple[int, int] = (1, 12),
             turns: tuple[int, int] = (5, 40), system_blocks: int = 2, in_turn: bool = False) -> Trace:
    """Agentic sessions: ``users`` concurrent long sessions, one request at a time from a random
    user; each request re-sends its session's whole context and adds ``new_blocks``; a session
    ends after ``turns`` requests and its user starts a new one. Chains grow long and come back
    after the other users' turns, so keeping heads whole matters more than telling blocks apart.
    With ``in_turn`` the users take turns in a fixed order (a loop of sessions), not at random."""
    rnd = random.Random(seed)
    fresh = itertools.count(1 << 20)
    system = [next(fresh) for _ in range(system_blocks)]
    live: list[tuple[list[int], int]] = [(list(system), rnd.randint(*turns)) for _ in range(users)]
    chains: list[list[int]] = []
    total = 0
    while total < refs:
        u = len(chains) % users if in_turn else rnd.randrange(users)
        blocks, left = live[u]
        blocks = blocks + [next(fresh) for _ in range(rnd.randint(*new_blocks))]
        chains.append(blocks)
        total += len(blocks)
        live[u] = (blocks, left - 1) if left > 1 else (list(system), rnd.randint(*turns))
    return _trace("sessions", chains)


def standard_workloads() -> list[tuple[Trace, list[int]]]:
    """The workloads the default policy must not lose on, each with the capacities (blocks) tested."""
    return [
        (loop(900, 40_000), [1000]),
        (loop(1200, 40_000), [1000]),
        (zipf(20_000, 60_000, 0.8), [500, 2000]),
        (zipf(20_000, 60_000, 1.1), [500, 2000]),
        (scan_hot(800, 60_000, 2000, 3000), [1000]),
        (shifting(600, 60_000, 8000), [1000]),
        (chat(80_000, seed=1), [1000, 4000]),
        (chat(80_000, seed=2, p_continue=0.8, think=(5, 50)), [1000, 4000]),
        (chat(80_000, seed=3, p_continue=0.3, think=(100, 1000)), [2000, 8000]),
        (sessions(80_000, seed=1), [300, 800]),
    ]
