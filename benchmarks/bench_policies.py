"""Eviction policies on a real trace: the issue's target table, with LRU, ARC and Belady's MIN beside.

    python benchmarks/bench_policies.py [--trace ../shared/traces/mooncake_conversation.jsonl]

Replays the trace at 1 %, 5 %, 10 % and 25 % of its distinct blocks through every registered policy
(the same residency and policy objects the cache uses, metadata only), prints the table, checks the
targets (default ≥ the better of LRU/ARC everywhere; ≥ 1/4 of the gap to MIN closed at 1 % and 5 %;
LRU ≥ 300k references/s; default ≤ 2 × LRU's cost per reference, timed in this run as the best CPU
time of four interleaved replays each), then replays the synthetic workloads the tests use. Writes a plot and
the JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for tests.policy.workloads

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvtier.policy import DEFAULT_EVICTION, EVICTION_POLICIES  # noqa: E402
from kvtier.replay import (  # noqa: E402
    ReplayResult,
    Trace,
    gap_closed,
    parse_capacity,
    plan_runs,
    plot_results,
    read_trace,
    replay,
    results_json,
    results_table,
    run_all,
)

CAPACITIES = ["1%", "5%", "10%", "25%"]


def timed(trace: Trace, policies: list[str], capacity: int, repeats: int) -> dict[str, float]:
    """Best CPU seconds per block reference of each policy over ``repeats`` interleaved replays."""
    best = dict.fromkeys(policies, float("inf"))
    for _ in range(repeats):
        for policy in policies:
            start = time.process_time()
            result = replay(trace, policy, [capacity])
            best[policy] = min(best[policy], (time.process_time() - start) / result.references)
    return best


def shown(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies below it (results files name no machine)."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory for plot and JSON")
    parser.add_argument("--repeats", type=int, default=4, help="replays per policy for the speed check")
    parser.add_argument("--no-synthetic", action="store_true", help="skip the synthetic workloads")
    args = parser.parse_args()
    console = Console(width=180)
    console.print(f"$ python {shlex.join(sys.argv)}")

    trace = read_trace(args.trace)
    capacities = [parse_capacity(c, trace.distinct_blocks) for c in CAPACITIES]
    policies = ["arc", *(p for p in EVICTION_POLICIES if p not in ("lru", "arc"))]
    started = time.perf_counter()
    results = run_all(trace, plan_runs(policies, capacities), lambda n: None)
    console.print(results_table(trace, results))
    console.print(f"({time.perf_counter() - started:.0f} s; default policy: {DEFAULT_EVICTION})\n")

    def pick(policy: str, capacity: int) -> ReplayResult:
        return next(r for r in results if r.policy == policy and r.capacities == [capacity])

    checks = Table(title="targets", title_justify="left")
    for column in ("capacity", "best of LRU/ARC", "default", "MIN", "default ≥ best", "gap closed",
                   "LRU refs/s", "default/LRU cost"):
        checks.add_column(column, justify="right")
    ok = True
    for label, capacity in zip(CAPACITIES, capacities, strict=True):
        lru, arc, default, ceiling = (pick(p, capacity) for p in ("lru", "arc", DEFAULT_EVICTION, "min"))
        best = max(lru, arc, key=lambda r: r.prefix_hit_ratio)
        share = gap_closed(default, best, ceiling)
        costs = timed(trace, ["lru", DEFAULT_EVICTION], capacity, args.repeats)
        lru_cost, default_cost = costs["lru"], costs[DEFAULT_EVICTION]
        beats = default.prefix_hit_ratio >= best.prefix_hit_ratio
        quarter = share is not None and share >= 0.25 if label in ("1%", "5%") else True
        fast = 1 / lru_cost >= 300_000 and default_cost <= 2 * lru_cost
        ok &= beats and fast
        checks.add_row(
            label, f"{best.prefix_hit_ratio:.4f} ({best.policy})", f"{default.prefix_hit_ratio:.4f}",
            f"{ceiling.prefix_hit_ratio:.4f}", "yes" if beats else "[red]NO[/red]",
            ("-" if share is None else f"{share:.0%}") + ("" if quarter else " [red](target 25%)[/red]"),
            f"{1 / lru_cost / 1000:.0f}k", f"{default_cost / lru_cost:.2f}×")
    console.print(checks)
    console.print("(prefix-hit token ratios; costs are the best CPU time of "
                  f"{args.repeats} interleaved replays, so other processes on the machine matter less)\n")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.trace).stem
    plot = plot_results(trace, results, out / f"policies_{stem}.png")
    (out / f"policies_{stem}.json").write_text(json.dumps(results_json(trace, results), indent=2))
    console.print(f"plot: {shown(plot)}\njson: {shown(out / f'policies_{stem}.json')}\n")

    if not args.no_synthetic:
        from tests.policy.workloads import standard_workloads

        table = Table(title="synthetic workloads (prefix-hit token ratio)", title_justify="left")
        for column in ("workload", "refs", "distinct", "capacity", "lru", "arc", DEFAULT_EVICTION, "min",
                       "default − lru"):
            table.add_column(column, justify="right")
        for workload, caps in standard_workloads():
            for capacity in caps:
                got = {p: replay(workload, p, [capacity]).prefix_hit_ratio
                       for p in ("lru", "arc", DEFAULT_EVICTION, "min")}
                delta = got[DEFAULT_EVICTION] - got["lru"]
                ok &= delta >= -0.01
                table.add_row(workload.name, f"{workload.references:,}", f"{workload.distinct_blocks:,}",
                              f"{capacity:,}", *(f"{v:.4f}" for v in got.values()),
                              f"{delta:+.4f}" if delta >= -0.01 else f"[red]{delta:+.4f}[/red]")
        console.print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
