"""Replay request traces through the cache's own residency and policy objects, metadata only.

``kvtier replay`` answers "what would this policy and placement have done on this workload": one
:class:`~kvtier.residency.TierIndex` per tier and a :class:`~kvtier.residency.Residency`, the objects
:class:`~kvtier.cache.TieredCache` plans with, and per request what the cache does (locate, touch,
promote, store), with plans executed against nothing and counted. Beside every policy it replays
LRU and two ceilings (Belady's MIN under the replay's rules, Belady with bypass). docs/policies.md
describes the rules, the trace formats and the output columns.

One module: a replay and the table of its results are read together (the table's columns are the
replay's counters, its baselines the runs the replay adds); traces and their formats are
:mod:`kvtier.traces`, the command line is :mod:`kvtier.cli_replay`, the policies are in
:mod:`kvtier.policy`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.blocks import BlockKey
from kvtier.policy import DEFAULT_EVICTION, EvictionPolicy, InsertHint
from kvtier.policy.admission import AdmitAll
from kvtier.policy.belady import NEVER, BeladyPolicy
from kvtier.policy.placement import PlacementPolicy
from kvtier.residency import READY, Residency, TierIndex
from kvtier.traces import Trace

# kvtier.replay was their home: code that imports them from here keeps working
from kvtier.traces import TraceFormatError as TraceFormatError
from kvtier.traces import read_trace as read_trace

#: KV bytes per token of Llama-3-8B in bf16 (32 layers × 2 × 8 KV heads × 128 × 2 bytes); the default
#: for turning block counts into bytes.
DEFAULT_BYTES_PER_TOKEN = 131072
MIN_POLICY = "min"
#: Belady with bypass, per block reference: the block-hit ceiling no admit-every-miss cache reaches.
BELADY_POLICY = "belady"
CEILINGS = (MIN_POLICY, BELADY_POLICY)


def parse_capacity(spec: str | int, distinct_blocks: int) -> int:
    """``"5%"`` (of the trace's distinct blocks, rounded half up, at least 1) or a block count."""
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100 or math.isnan(share):
                raise ValueError
            return max(1, math.floor(distinct_blocks * share / 100 + 0.5))
        blocks = int(text)
    except ValueError:
        raise ValueError(f"capacity {spec!r} is neither a block count nor a percentage like 5%") from None
    if blocks <= 0:
        raise ValueError(f"capacity must be a positive number of blocks, got {spec!r}")
    return blocks


# --- results ---------------------------------------------------------------------------------------


@dataclass
class TierResult:
    """What one tier did during a replay, in blocks (bytes = blocks × block bytes)."""

    name: str
    capacity_blocks: int
    hits: int = 0  # prefix blocks served from this tier
    written: int = 0  # stores, demotions in and promotions in
    read: int = 0  # hits served plus demotions out
    evicted: int = 0
    promoted_in: int = 0
    demoted_in: int = 0


@dataclass
class ReplayResult:
    policy: str
    capacities: list[int]
    references: int
    block_hits: int
    prefix_hit_tokens: int
    input_tokens: int
    seconds: float
    block_bytes: int
    tiers: list[TierResult] = field(default_factory=list)

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.references if self.references else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def refs_per_second(self) -> float:
        return self.references / self.seconds if self.seconds > 0 else float("inf")

    @property
    def total_capacity(self) -> int:
        return sum(self.capacities)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "capacity_blocks": self.capacities, "references": self.references,
            "block_hits": self.block_hits, "block_hit_ratio": self.block_hit_ratio,
            "prefix_hit_tokens": self.prefix_hit_tokens, "input_tokens": self.input_tokens,
            "prefix_hit_ratio": self.prefix_hit_ratio, "seconds": self.seconds,
            "refs_per_second": self.refs_per_second, "block_bytes": self.block_bytes,
            "tiers": [{"name": t.name, "capacity_blocks": t.capacity_blocks, "hits": t.hits,
                       "blocks_written": t.written, "blocks_read": t.read, "evicted": t.evicted,
                       "promoted_in": t.promoted_in, "demoted_in": t.demoted_in,
                       "bytes_written": t.written * self.block_bytes, "bytes_read": t.read * self.block_bytes}
                      for t in self.tiers],
        }


# --- the harness -----------------------------------------------------------------------------------


def next_uses(trace: Trace) -> list[int]:
    """For each block reference (requests flattened), the index of the next reference of its key."""
    flat = [key for request in trace.requests for key in request]
    out = [NEVER] * len(flat)
    later: dict[BlockKey, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        key = flat[i]
        out[i] = later.get(key, NEVER)
        later[key] = i
    return out


ProgressFn = Callable[[int], None]


def replay(trace: Trace, policy: str, capacities: Sequence[int], placement: PlacementPolicy | None = None,
           *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN, progress: ProgressFn | None = None,
           future: list[int] | None = None,
           make_policy: Callable[[], EvictionPolicy] | None = None) -> ReplayResult:
    """Replay ``trace`` through tiers of ``capacities`` blocks (top first) under one eviction policy.

    ``policy`` is an eviction policy name (``default`` = :data:`DEFAULT_EVICTION`) used in every
    tier, ``min`` for Belady's MIN under these rules or ``belady`` for Belady with bypass (both one
    tier only; ``future`` may pass :func:`next_uses` to save recomputing it). ``placement`` defaults
    to write-back, admit-all, promote-to-top. ``make_policy`` builds each tier's policy object
    instead of the factory (to inspect it after; ``policy`` is then only its label). ``progress`` is
    called with the number of block references done so far, every few hundred requests. Per
    request, as the cache does it: the leading cached blocks are hits (touched, and promoted per the
    placement); the remaining blocks are stored (those still cached somewhere only touched); every
    planned write and demotion then succeeds. A block *hit* is a block cached (in any tier) when its
    request arrives; a *prefix hit* also needs every block before it cached.
    """
    if policy == "default":
        policy = DEFAULT_EVICTION
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities must be positive block counts, got {list(capacities)}")
    if policy == BELADY_POLICY:
        if len(capacities) != 1:
            raise ValueError("Belady with bypass is defined for one tier; replay it at the total capacity")
        return belady_bypass(trace, capacities[0], future=future, bytes_per_token=bytes_per_token)
    num_tiers = len(capacities)
    if placement is None:
        placement = PlacementPolicy([AdmitAll() for _ in range(num_tiers)])
    elif placement.num_tiers != num_tiers:
        raise ValueError(f"placement has rules for {placement.num_tiers} tiers but {num_tiers} capacities")
    oracle: BeladyPolicy | None = None
    if policy == MIN_POLICY:
        if num_tiers != 1:
            raise ValueError("Belady's MIN is defined for one tier; replay it at the total capacity")
        oracle = BeladyPolicy()
        indexes = [TierIndex("tier0", {0: capacities[0]}, {0: 1}, policies={0: oracle})]
        if future is None:
            future = next_uses(trace)
    else:
        indexes = [TierIndex(f"tier{t}", {0: cap}, {0: 1}, policy,
                             policies=None if make_policy is None else {0: make_policy()})
                   for t, cap in enumerate(capacities)]
    residency = Residency(indexes, placement)
    tiers = [TierResult(index.name, cap) for index, cap in zip(indexes, capacities, strict=True)]
    hits_in = [0] * num_tiers
    block_tokens = trace.block_tokens

    locate_prefix = residency.locate_prefix
    locate = residency.locate
    touch = residency.touch
    plan_store = residency.plan_store
    finish_write = residency.finish_write
    finish_demotion = residency.finish_demotion
    observe = oracle.observe if oracle is not None else None
    entries0 = indexes[0].entries
    get0 = entries0.get
    settle0 = indexes[0].settle
    access_all0 = indexes[0].policies[0].access_all  # the replay's keys are all of group 0
    all_hints = trace.chain_hints()
    tokens = trace.tokens

    block_hits = prefix_tokens = evicted0 = written0 = 0
    done = base = 0
    started = time.perf_counter()
    for r, keys in enumerate(trace.requests):
        n = len(keys)
        if observe is not None:
            assert future is not None
            for j in range(n):
                observe(keys[j], future[base + j])
            base += n
        if num_tiers == 1:
            # locate_prefix and touch, inlined for one tier: the leading READY run is the prefix hit,
            # touched in one call
            k0 = 0
            for key in keys:
                if get0(key) != READY:
                    break
                k0 += 1
            if k0:
                access_all0(keys if k0 == n else keys[:k0])
            if k0 < n:
                if k0:
                    prefix_tokens += k0 * block_tokens
                    rest = keys[k0:]
                    hints = all_hints[r][k0:]
                    block_hits += k0 + [get0(key) for key in keys[k0 + 1:]].count(READY)
                else:
                    rest = keys
                    hints = all_hints[r]
                    block_hits += [get0(key) for key in keys[1:]].count(READY)
                plan = plan_store(rest, hints)
                evicted0 += len(plan.drops[0])
                writes = plan.writes[0]
                written0 += len(writes)
                for i in writes:
                    settle0(rest[i], True)
            elif n:
                prefix_tokens += tokens[r]
                block_hits += n
            hits_in[0] += k0
        else:
            found = locate_prefix(keys)
            k0 = len(found)
            if k0:
                for j in range(k0):
                    touch(found[j], keys[j])
                for t in found:
                    hits_in[t] += 1
                _promote(residency, keys, found, tiers)
                prefix_tokens += k0 * block_tokens if k0 < n else tokens[r]
            if k0 < n:
                rest = keys[k0:] if k0 else keys
                block_hits += k0 + sum(1 for key in rest[1:] if locate(key) is not None)
                plan = plan_store(rest, all_hints[r][k0:])
                _execute(plan, rest, tiers, finish_write, finish_demotion)
            else:
                block_hits += k0
        done += n
        if progress is not None and not r & 255:
            progress(done)
    seconds = time.perf_counter() - started
    if progress is not None:
        progress(done)
    for t, tier in enumerate(tiers):
        tier.hits = hits_in[t]
        tier.read += hits_in[t]
    if num_tiers == 1:
        tiers[0].evicted += evicted0
        tiers[0].written += written0
    return ReplayResult(policy=policy, capacities=list(capacities), references=done, block_hits=block_hits,
                        prefix_hit_tokens=prefix_tokens, input_tokens=trace.input_tokens, seconds=seconds,
                        block_bytes=block_tokens * bytes_per_token, tiers=tiers)


def _execute(plan: Any, keys: Sequence[BlockKey], tiers: list[TierResult],
             finish_write: Callable[[int, BlockKey, bool], None],
             finish_demotion: Callable[[int, int, BlockKey, bool], None]) -> None:
    """Run a plan against nothing: demotions and drops bottom-up, then the writes; all succeed."""
    for t in range(len(tiers) - 1, -1, -1):
        for key, dst in plan.demotions[t]:
            finish_demotion(t, dst, key, True)
            tiers[t].read += 1
            tiers[dst].written += 1
            tiers[dst].demoted_in += 1
        tiers[t].evicted += len(plan.drops[t])
    for t, writes in enumerate(plan.writes):
        tiers[t].written += len(writes)
        for i in writes:
            finish_write(t, keys[i], True)


def chain_hints(keys: Sequence[BlockKey], start: int, stop: int) -> list[InsertHint]:
    """Insert hints for ``keys[start:stop]`` of one request: position, and the previous block as
    predecessor."""
    return [InsertHint(j, -1, keys[j - 1] if j else None) for j in range(start, stop)]


def _promote(residency: Residency, keys: Sequence[BlockKey], found: Sequence[int],
             tiers: list[TierResult]) -> None:
    """Copy lower-tier hits up as the cache does (the same :meth:`Residency.plan_promotion`; from the
    loaded bytes: no extra read)."""
    promotion = residency.plan_promotion(keys, found)
    if promotion is None:
        return
    _execute(promotion.plan, promotion.keys, tiers, residency.finish_write, residency.finish_demotion)
    written = promotion.plan.writes[promotion.target]  # every write succeeds here
    tiers[promotion.target].promoted_in += len(written)
    residency.finish_promotion(promotion, written)


def belady_bypass(trace: Trace, capacity: int, *, future: list[int] | None = None,
                  bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN) -> ReplayResult:
    """Belady's MIN with bypass over the flattened block references, in ``capacity`` blocks.

    A reference to a cached block is a hit; a missing block is cached only if it is referenced
    again, evicting the cached block referenced farthest in the future when that is later than its
    own next reference — otherwise it bypasses the cache. This is the block-hit optimum of a
    single tier; a request's prefix hit is its leading run of hits, so the prefix figure is what
    this schedule gets, not a prefix-hit optimum.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive block count, got {capacity}")
    if future is None:
        future = next_uses(trace)
    cached: dict[BlockKey, int] = {}  # key -> its next reference
    heap: list[tuple[int, BlockKey]] = []  # (-next reference, key); stale entries skipped
    heappush, heappop = heapq.heappush, heapq.heappop
    block_hits = prefix_tokens = written = evicted = 0
    i = 0
    block_tokens = trace.block_tokens
    started = time.perf_counter()
    for r, keys in enumerate(trace.requests):
        leading = True
        k0 = 0
        for key in keys:
            nxt = future[i]
            i += 1
            if key in cached:
                block_hits += 1
                if leading:
                    k0 += 1
            else:
                leading = False
                if nxt == NEVER:
                    continue
                if len(cached) >= capacity:
                    while heap and cached.get(heap[0][1]) != -heap[0][0]:
                        heappop(heap)
                    if -heap[0][0] <= nxt:
                        continue  # every cached block is needed sooner: bypass
                    del cached[heappop(heap)[1]]
                    evicted += 1
                written += 1
            if nxt == NEVER:
                del cached[key]
            else:
                cached[key] = nxt
                heappush(heap, (-nxt, key))
                if len(heap) > 2 * len(cached) + 64:
                    heap = [(-n, k) for k, n in cached.items()]
                    heapq.heapify(heap)
        if k0:
            prefix_tokens += k0 * block_tokens if k0 < len(keys) else trace.tokens[r]
    seconds = time.perf_counter() - started
    tier = TierResult("tier0", capacity, hits=block_hits, written=written, read=block_hits, evicted=evicted)
    return ReplayResult(policy=BELADY_POLICY, capacities=[capacity], references=i, block_hits=block_hits,
                        prefix_hit_tokens=prefix_tokens, input_tokens=trace.input_tokens, seconds=seconds,
                        block_bytes=block_tokens * bytes_per_token, tiers=[tier])


def gap_closed(result: ReplayResult, baseline: ReplayResult, ceiling: ReplayResult) -> float | None:
    """Share of the prefix-hit gap between a baseline and MIN that ``result`` closes (None: no gap, or one
    under 0.0005 — a share of nothing is noise)."""
    gap = ceiling.prefix_hit_ratio - baseline.prefix_hit_ratio
    if gap < 5e-4:
        return None
    return (result.prefix_hit_ratio - baseline.prefix_hit_ratio) / gap


# --- many runs, and their report ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One replay to do: an eviction policy over tiers of these capacities (blocks, top first)."""

    policy: str
    capacities: tuple[int, ...]


def plan_runs(policies: Sequence[str], capacities: Sequence[int], tier_sets: Sequence[Sequence[int]] = (),
              *, with_min: bool = True) -> list[RunSpec]:
    """LRU, the requested policies and both ceilings (``min``, ``belady``) at each single-tier
    capacity, then each multi-tier set (ceilings at its total capacity: those of any hierarchy that size)."""
    names: list[str] = ["lru"]
    for p in policies:
        p = DEFAULT_EVICTION if p == "default" else p
        if p not in names and p not in CEILINGS:
            names.append(p)
    runs: list[RunSpec] = []
    for cap in capacities:
        runs.extend(RunSpec(p, (cap,)) for p in names)
        if with_min:
            runs.extend(RunSpec(c, (cap,)) for c in CEILINGS)
    for caps in tier_sets:
        runs.extend(RunSpec(p, tuple(caps)) for p in names)
        if with_min and (sum(caps),) not in {r.capacities for r in runs if r.policy == MIN_POLICY}:
            runs.extend(RunSpec(c, (sum(caps),)) for c in CEILINGS)
    return runs


def run_all(trace: Trace, runs: Sequence[RunSpec], placement: Callable[[int], PlacementPolicy | None],
            *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
            progress: Callable[[int, str], None] | None = None) -> list[ReplayResult]:
    """Replay each run; ``placement(num_tiers)`` gives fresh placement rules (None: defaults).

    ``progress(references_done_in_this_run, label)`` is called as runs advance.
    """
    future = next_uses(trace) if any(r.policy in CEILINGS for r in runs) else None
    results = []
    for run in runs:
        label = f"{run.policy} @ {'+'.join(map(str, run.capacities))}"
        tick = (lambda done, label=label: progress(done, label)) if progress is not None else None
        rules = None if run.policy in CEILINGS or len(run.capacities) == 1 else placement(len(run.capacities))
        results.append(replay(trace, run.policy, run.capacities, rules, bytes_per_token=bytes_per_token,
                              progress=tick, future=future))
    return results


def _baselines(results: Sequence[ReplayResult], result: ReplayResult) -> tuple[ReplayResult | None,
                                                                               ReplayResult | None]:
    """The better of LRU/ARC with ``result``'s tier capacities, and MIN (replay rules) at its total
    capacity."""
    best = ceiling = None
    for r in results:
        if r.policy == MIN_POLICY and r.capacities == [result.total_capacity]:
            ceiling = r
        elif (r.policy in ("lru", "arc") and r.capacities == result.capacities
              and (best is None or r.prefix_hit_ratio > best.prefix_hit_ratio)):
            best = r
    return best, ceiling


def _closed(results: Sequence[ReplayResult], result: ReplayResult) -> tuple[float | None, str | None]:
    """Share of the gap between the better of LRU/ARC and ``min`` (the replay-rules MIN, the ceiling
    of any policy the cache can run) that ``result`` closes, and that baseline."""
    if result.policy in ("lru", "arc", *CEILINGS):
        return None, None
    best, ceiling = _baselines(results, result)
    if best is None or ceiling is None:
        return None, None
    return gap_closed(result, best, ceiling), best.policy


def trace_note(trace: Trace) -> dict[str, Any]:
    """What the results of ``trace`` can and cannot say, for under the table and for ``--json``.

    ``note`` is None unless the hit ratios are 0 by construction: a format without prefix information
    (Azure CSV), or a trace in which no block id repeats.
    """
    duration = trace.duration_seconds
    n = len(trace.requests)
    rate = n / duration if duration else None
    note = None
    if trace.references and (not trace.prefix_information or trace.distinct_blocks == trace.references):
        why = (f"the {trace.format} format has arrival times and lengths only, no prefix information, so "
               f"every block of every request gets an id of its own"
               if not trace.prefix_information else "no block id occurs twice in this trace")
        arrivals = (f"{n:,} requests over {duration:,.0f} s, {rate:.2f}/s"
                    if duration and rate is not None else f"{n:,} requests, no timestamps")
        note = (f"every hit ratio here is 0 by construction: {why}, and a block never seen before "
                f"cannot hit — for every policy and both ceilings, so the table says nothing about the "
                f"policies. Still good for: the arrival pattern ({arrivals}); write volume (all "
                f"{trace.references:,} block references miss; what fits is stored, see written per "
                f"tier; belady bypasses them all); tier churn (evictions once a tier is full).")
    return {"format": trace.format, "prefix_information": trace.prefix_information, "requests": n,
            "duration_seconds": duration, "requests_per_second": rate, "note": note}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def results_table(trace: Trace, results: Sequence[ReplayResult]) -> Any:
    """A :class:`rich.table.Table` of the results, grouped by capacity, baselines and MIN beside."""
    from rich.markup import escape
    from rich.table import Table

    multi = any(len(r.capacities) > 1 for r in results)
    table = Table(title=f"{escape(trace.name)}: {len(trace.requests):,} requests, "
                        f"{trace.references:,} block references, "
                        f"{trace.distinct_blocks:,} distinct blocks of {trace.block_tokens} tokens",
                  title_justify="left")
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("policy")
    table.add_column("block hit", justify="right")
    table.add_column("prefix-hit tokens", justify="right")
    table.add_column("vs LRU", justify="right")
    table.add_column("gap to min closed", justify="right")
    if multi:
        table.add_column("hits per tier", justify="right")
    table.add_column("written per tier", justify="right")
    table.add_column("read per tier", justify="right")
    table.add_column("refs/s", justify="right")
    previous = None
    for r in results:
        shape = tuple(r.capacities)
        if previous is not None and shape != previous:
            table.add_section()
        previous = shape
        lru = next((x for x in results if x.policy == "lru" and tuple(x.capacities) == shape), None)
        share, baseline = _closed(results, r)
        # a policy row with a baseline but no share: MIN is no better than it (0 % of nothing is not 0 %)
        closed = (f"{share:.0%} (from {baseline})" if share is not None else
                  "n/a (no gap)" if baseline is not None else "")
        delta = "" if lru is None or r is lru else f"{r.prefix_hit_ratio - lru.prefix_hit_ratio:+.4f}"
        pct = "+".join(f"{c:,} ({100 * c / max(1, trace.distinct_blocks):.3g}%)" for c in r.capacities)
        row = [pct, r.policy, f"{r.block_hit_ratio:.4f}", f"{r.prefix_hit_ratio:.4f}", delta, closed]
        if multi:
            row.append(" / ".join(f"{t.hits:,}" for t in r.tiers))
        row.append(" / ".join(_size(t.written * r.block_bytes) for t in r.tiers))
        row.append(" / ".join(_size(t.read * r.block_bytes) for t in r.tiers))
        row.append(f"{r.refs_per_second / 1000:,.0f}k")
        table.add_row(*row, style="dim" if r.policy in CEILINGS else None)
    return table


def results_json(trace: Trace, results: Sequence[ReplayResult]) -> dict[str, Any]:
    """Everything in the table, for machines (ratios unrounded, sizes in blocks and bytes)."""
    out = []
    for r in results:
        item = r.to_dict()
        item["capacity_share"] = [c / max(1, trace.distinct_blocks) for c in r.capacities]
        item["gap_closed"], item["gap_baseline"] = _closed(results, r)
        item["gap_ceiling"] = MIN_POLICY if item["gap_closed"] is not None else None
        out.append(item)
    return {"trace": trace.summary(), "trace_note": trace_note(trace), "default_policy": DEFAULT_EVICTION,
            "results": out}


def check_plot_target(path: str | Path) -> None:
    """Refuse a plot that would fail after the replay: no matplotlib, an unknown format, an unwritable folder.

    Raises :class:`kvtier.extras.MissingExtra` or ``ValueError`` naming the problem.
    """
    import os

    from kvtier.extras import require

    require("matplotlib")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{str(out)!r} is a directory; give a file name such as {str(out / 'replay.png')!r}")
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        problem = "no file extension" if not suffix else f".{suffix} is not a format matplotlib writes"
        raise ValueError(f"{str(out)!r}: {problem}; "
                         f"use .png, .svg or .pdf (or one of {', '.join(sorted(formats))})")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write {str(out)!r}: {str(folder)!r} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {str(out)!r}: no write permission in {str(folder)!r}")


def plot_results(trace: Trace, results: Sequence[ReplayResult], path: str | Path) -> Path:
    """Hit ratio against capacity (% of distinct blocks, log scale), one line per policy; PNG/SVG/PDF."""
    from kvtier.extras import require

    matplotlib = require("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = [r for r in results if len(r.capacities) == 1]
    shown = single or list(results)
    policies = list(dict.fromkeys(r.policy for r in shown))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, (attr, label) in zip(axes, (("prefix_hit_ratio", "prefix-hit token ratio"),
                                        ("block_hit_ratio", "block hit ratio")), strict=True):
        for policy in policies:
            points = sorted((100 * r.total_capacity / max(1, trace.distinct_blocks), getattr(r, attr))
                            for r in shown if r.policy == policy)
            xs, ys = zip(*points, strict=True)
            style = ({"color": "black", "linestyle": "--"} if policy == MIN_POLICY else
                     {"color": "grey", "linestyle": ":"} if policy == BELADY_POLICY else {})
            name = f"{policy} (default)" if policy == DEFAULT_EVICTION else policy
            name = {MIN_POLICY: "MIN (replay rules)", BELADY_POLICY: "Belady with bypass"}.get(policy, name)
            ax.plot(xs, ys, marker="o", label=name, **style)
        ax.set_xscale("log")
        shares = sorted({100 * r.total_capacity / max(1, trace.distinct_blocks) for r in shown})
        ax.set_xticks(shares, [f"{x:.3g}" for x in shares])
        ax.minorticks_off()
        ax.set_xlabel("capacity (% of distinct blocks)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize="small")
    fig.suptitle(f"{trace.name} ({trace.references:,} block references)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
