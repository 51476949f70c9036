"""How far can an online eviction policy get on a trace? An upper bound next to MIN and the peers.

    python benchmarks/policy_bound.py [--trace ../shared/traces/mooncake_conversation.jsonl]
                                      [--capacity 1% 5% 10% 25%]

Belady's MIN knows the future; an online policy knows, for each block, what was known when it was
last referenced (its *class*: how often it was seen, how deep its request's chain is, …) and how
long ago that was (its *age*). The best any such policy can do is to give each class the lifetime
that buys the most hits per slot. This script computes that optimum offline, with perfect
knowledge of every class's reuse distances over the whole trace and the capacity relaxed to an
average (both favour the bound), for several sets of causal features:

* ``count``  — references of the block so far (1, 2, ≥3): what the ``lifetime`` policy uses;
* ``level``  — depth of the request's chain: 1 + the level of the request that introduced its
  deepest previously seen block (turn number of a conversation, offset by shared system prompts);
* ``last``   — the block is its request's last (a partial block, replaced in the next turn);
* ``new``    — how many blocks at the end of the request were never seen before (its new segment);
* ``gap``    — references since the request's deepest previously seen block was last referenced
  (the time its user took to come back last time).

Each row of the table is the bound for one feature set (how many classes it makes), beside LRU, ARC,
the default policy and MIN replayed through ``kvtier replay``'s harness, and the issue's target
(the better of LRU/ARC plus a quarter of its gap to MIN, in prefix-hit tokens). The bound counts
block hits; prefix-hit tokens track block hits within ~0.007 on Mooncake (MIN: 0.3664 / 0.3736).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtier.replay import Trace, next_uses, parse_capacity, read_trace, replay  # noqa: E402

NEVER = np.int64(1 << 62)
#: Candidate lifetimes (references): a log grid fine enough that the hull is close to exact.
LIFETIMES = np.unique(np.round(np.logspace(0, 7, 400)).astype(np.int64))


def features(trace: Trace) -> dict[str, np.ndarray]:
    """Per block reference (requests flattened), each causal feature, bucketed."""
    ids: dict[object, int] = {}
    seen_count: dict[int, int] = {}
    born_level: dict[int, int] = {}
    last_ref: dict[int, int] = {}
    count, level, last, new, gap = [], [], [], [], []
    t = 0
    for keys in trace.requests:
        chain = [ids.setdefault(k, len(ids)) for k in keys]
        n = len(chain)
        j = n
        while j > 0 and chain[j - 1] not in seen_count:
            j -= 1  # chain[:j] was seen before, chain[j:] is the new segment
        request_level = born_level[chain[j - 1]] + 1 if j else 0
        since = t - last_ref[chain[j - 1]] if j else -1
        for b in chain[j:]:
            born_level.setdefault(b, request_level)
        gap_bucket = 5 if since < 0 else min(4, int(math.log2(since / 1000 + 1)))
        new_bucket = min(3, int(math.log2(n - j + 1)))
        for p, b in enumerate(chain):
            c = seen_count.get(b, 0) + 1
            seen_count[b] = c
            count.append(min(c, 3))
            level.append(min(request_level, 6))
            last.append(int(p == n - 1))
            new.append(new_bucket)
            gap.append(gap_bucket)
            t += 1
            last_ref[b] = t
    return {name: np.array(values, dtype=np.int64)
            for name, values in (("count", count), ("level", level), ("last", last), ("new", new), ("gap", gap))}


def classes_of(feats: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """One class id per reference for the combination of ``names`` (an empty list: one class)."""
    out = np.zeros_like(next(iter(feats.values())))
    for name in names:
        out = out * 16 + feats[name]
    return out


def lifetime_bound(distances: np.ndarray, classes: np.ndarray, capacity: int) -> float:
    """Block hit ratio of the best per-class lifetimes within ``capacity`` slots on average.

    Holding a class-``c`` block for ``A`` references after each reference costs ``min(d, A)`` slot-
    references and hits when ``d <= A`` (``d``: distance to its next reference). The per-class
    (cost, hits) curves' upper concave hulls, walked greedily by slope, give the optimum.
    """
    budget = float(capacity) * len(distances)
    segments: list[tuple[float, float, float]] = []  # (hits per slot-reference, cost, hits)
    for c in np.unique(classes):
        d = np.sort(distances[classes == c])
        prefix = np.concatenate([[0], np.cumsum(np.minimum(d, NEVER // len(d)), dtype=np.float64)])
        k = np.searchsorted(d, LIFETIMES, side="right")
        cost = prefix[k] + (len(d) - k) * LIFETIMES.astype(np.float64)
        hull: list[tuple[float, float]] = [(0.0, 0.0)]
        for x, y in zip(cost.tolist(), k.astype(np.float64).tolist(), strict=True):
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) >= 0:
                    hull.pop()
                else:
                    break
            hull.append((x, y))
        for (x0, y0), (x1, y1) in zip(hull, hull[1:], strict=False):
            if x1 > x0 and y1 > y0:
                segments.append(((y1 - y0) / (x1 - x0), x1 - x0, y1 - y0))
    segments.sort(key=lambda s: -s[0])
    hits, left = 0.0, budget
    for _, cost, gain in segments:
        if left <= 0:
            break
        share = min(1.0, left / cost)
        hits += gain * share
        left -= cost * share
    return hits / len(distances)


FEATURE_SETS: list[tuple[str, ...]] = [
    (), ("count",), ("level",), ("count", "level"), ("count", "last", "new"), ("count", "gap"),
    ("count", "last", "new", "gap"), ("level", "count", "last", "new", "gap"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"))
    parser.add_argument("--capacity", nargs="+", default=["1%", "5%", "10%", "25%"])
    args = parser.parse_args()
    console = Console(width=180)
    console.print(f"$ python {shlex.join(sys.argv)}")
    started = time.perf_counter()
    trace = read_trace(args.trace)
    capacities = [parse_capacity(c, trace.distinct_blocks) for c in args.capacity]
    future = next_uses(trace)
    index = np.arange(len(future), dtype=np.int64)
    nxt = np.array(future, dtype=np.int64)
    distances = np.where(nxt < len(future), nxt - index, NEVER)
    feats = features(trace)

    table = Table(title=f"{trace.name}: {trace.references:,} block references, {trace.distinct_blocks:,} distinct "
                        f"blocks — block hit ratio (prefix-hit token ratio)", title_justify="left")
    table.add_column("")
    table.add_column("classes", justify="right")
    for spec, cap in zip(args.capacity, capacities, strict=True):
        table.add_column(f"{spec} ({cap:,})", justify="right")
    replayed = {p: [replay(trace, p, [cap], future=future) for cap in capacities]
                for p in ("lru", "arc", "default", "min")}
    for policy in ("lru", "arc", "default", "min"):
        table.add_row(f"{policy} (replayed)", "",
                      *(f"{r.block_hit_ratio:.4f} ({r.prefix_hit_ratio:.4f})" for r in replayed[policy]))
    targets = []
    for i in range(len(capacities)):
        best = max(replayed["lru"][i].prefix_hit_ratio, replayed["arc"][i].prefix_hit_ratio)
        targets.append(best + (replayed["min"][i].prefix_hit_ratio - best) / 4)
    table.add_row("target: best of LRU/ARC + ¼ gap to MIN", "", *(f"({t:.4f})" for t in targets))
    table.add_section()
    for names in FEATURE_SETS:
        classes = classes_of(feats, names)
        bounds = [lifetime_bound(distances, classes, cap) for cap in capacities]
        table.add_row("bound: " + (" × ".join(names) or "one class (age only)"), f"{len(np.unique(classes))}",
                      *(f"{b:.4f}" for b in bounds))
    console.print(table)
    console.print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
