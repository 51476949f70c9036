"""``kvtier replay TRACE``: replay a request trace through the cache's policies, metadata only.

Thin: parses arguments, calls :mod:`kvtier.replay`, prints a rich table (or JSON) and optionally a
plot. Exit codes: 0 ok, 2 bad usage, trace or config.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.errors import KVTierConfigError
from kvtier.extras import MissingExtra
from kvtier.hostinfo import available_memory
from kvtier.policy import DEFAULT_EVICTION, EVICTION_POLICIES
from kvtier.policy.admission import ADMISSION_POLICIES, make_admission_policy
from kvtier.policy.placement import PlacementPolicy
from kvtier.replay import (
    CEILINGS,
    DEFAULT_BYTES_PER_TOKEN,
    check_plot_target,
    parse_capacity,
    plan_runs,
    plot_results,
    results_json,
    results_table,
    run_all,
    trace_note,
)
from kvtier.traces import (
    TRACE_FORMATS,
    TraceFormatError,
    TraceTooLargeError,
    check_replay_memory,
    read_trace,
)

DEFAULT_CAPACITIES = ["1%", "5%", "10%", "25%"]


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``replay`` on the ``kvtier`` command's subparsers."""
    policies = sorted(EVICTION_POLICIES)
    p = subparsers.add_parser(
        "replay", help="replay a request trace through eviction and placement policies (no bytes moved)",
        description="Replay a Mooncake or generic JSONL trace, or an Azure CSV trace, through the cache's "
                    "own residency, "
                    "eviction and placement objects, metadata only. LRU and Belady's MIN are always "
                    "replayed beside the policies asked for.")
    p.add_argument("trace", help="JSONL trace (Mooncake's hash_ids lines, or kvtier's generic format), or an "
                                 "Azure or BurstGPT CSV trace (TIMESTAMP,ContextTokens,... / Timestamp,...,"
                                 "Request tokens,...; no prefix information)")
    p.add_argument("--format", choices=list(TRACE_FORMATS), default="auto")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per block id (default: read off a Mooncake-format file, 512 where it fits; "
                        "the header's or 16 for generic; 16 for azure and burstgpt)")
    p.add_argument("--capacity", nargs="+", default=None, metavar="CAP",
                   help="single-tier capacities: block counts or %% of the trace's distinct blocks "
                        f"(default: {' '.join(DEFAULT_CAPACITIES).replace('%', '%%')} "
                        "unless --tiers is given)")
    p.add_argument("--tiers", nargs="+", default=[], metavar="CAP,CAP[,...]",
                   help="multi-tier capacities, top tier first (e.g. 1%%,10%%); each value is one hierarchy")
    p.add_argument("--policy", nargs="+", default=["default"], metavar="NAME",
                   help=f"eviction policies: {', '.join(policies)}, or 'default' ({DEFAULT_EVICTION}); "
                        f"lru and the ceilings min and belady are always added")
    p.add_argument("--write-mode", choices=["write_back", "write_through"], default="write_back",
                   help="multi-tier: demote on eviction (write_back) or write every tier (write_through)")
    p.add_argument("--no-promote", action="store_true",
                   help="multi-tier: leave lower-tier hits where they are")
    p.add_argument("--promote-to", type=int, default=0, help="multi-tier: tier index hits are promoted to")
    p.add_argument("--exclusive", action="store_true",
                   help="multi-tier: delete the lower copy of a promoted block (default: keep it)")
    p.add_argument("--admission", default=None, metavar="NAME[,NAME...]",
                   help=f"multi-tier: admission per tier ({', '.join(ADMISSION_POLICIES)}); "
                        "one name applies to every tier below the top")
    p.add_argument("--admission-history", type=int, default=65536,
                   help="keys remembered by admission filters")
    p.add_argument("--bytes-per-token", type=int, default=DEFAULT_BYTES_PER_TOKEN,
                   help="KV bytes per token for the bytes columns (default: Llama-3-8B bf16, 128 KiB)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--no-memory-check", action="store_true",
                   help="replay even when the estimate of the memory it takes exceeds what is available "
                        "(by default such a trace is refused before reading it whole, naming the --limit "
                        "that fits)")
    p.add_argument("--no-min", action="store_true",
                   help="skip the ceilings min and belady (MIN is the slowest run)")
    p.add_argument("--plot", metavar="FILE",
                   help="draw hit ratio against capacity per policy (PNG, SVG, PDF)")
    p.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_replay)
    return p


def _placement_factory(args: argparse.Namespace) -> Any:
    names = args.admission.split(",") if args.admission else None

    def build(num_tiers: int) -> PlacementPolicy:
        if names is None:
            per_tier = ["always"] * num_tiers
        elif len(names) == 1:
            per_tier = ["always"] + names * (num_tiers - 1)
        elif len(names) == num_tiers:
            per_tier = names
        else:
            raise KVTierConfigError("--admission", f"{len(names)} names for {num_tiers} tiers; "
                                                   "give one, or one per tier")
        admissions = []
        for i, name in enumerate(per_tier):
            try:
                admissions.append(make_admission_policy(name, args.admission_history))
            except KeyError as exc:
                raise KVTierConfigError(f"--admission[{i}]", str(exc.args[0])) from None
        try:
            return PlacementPolicy(admission=admissions, write_mode=args.write_mode,
                                   promote_on_hit=not args.no_promote, promote_to=args.promote_to,
                                   keep_lower_copy=not args.exclusive)
        except ValueError as exc:
            flag = "--promote-to" if "promote_to" in str(exc) else "--write-mode"
            raise KVTierConfigError(flag, str(exc)) from None

    return build


def run_replay(args: argparse.Namespace) -> int:
    """Do what ``kvtier replay`` was asked; returns the exit code."""
    err = Console(stderr=True)
    if args.plot:
        try:
            check_plot_target(args.plot)
        except (MissingExtra, ValueError) as exc:
            err.print(f"[red]--plot[/red] {escape(str(exc))}", soft_wrap=True)
            return 2
    for name in args.policy:
        if name not in EVICTION_POLICIES and name not in ("default", *CEILINGS):
            err.print(f"[red]unknown policy[/red] {escape(repr(name))}; "
                      f"known: {', '.join(sorted(EVICTION_POLICIES))}, default", soft_wrap=True)
            return 2
    budget = None if args.no_memory_check else available_memory()
    try:
        trace = read_trace(args.trace, format=args.format, block_tokens=args.block_tokens, limit=args.limit,
                           memory_budget=budget)
    except TraceTooLargeError as exc:
        err.print(f"[red]trace too large[/red] {escape(str(exc))} (or --no-memory-check)", soft_wrap=True)
        return 2
    except (TraceFormatError, ValueError) as exc:
        err.print(f"[red]bad trace[/red] {escape(str(exc))}", soft_wrap=True)
        return 2
    if not trace.requests:
        err.print(f"[red]bad trace[/red] {escape(args.trace)}: no requests", soft_wrap=True)
        return 2
    try:
        specs = args.capacity if args.capacity is not None else ([] if args.tiers else DEFAULT_CAPACITIES)
        capacities = [parse_capacity(c, trace.distinct_blocks) for c in specs]
        tier_sets = [[parse_capacity(c, trace.distinct_blocks) for c in group.split(",") if c]
                     for group in args.tiers]
        if any(len(t) < 2 for t in tier_sets):
            raise ValueError("each --tiers value needs two or more comma-separated capacities (e.g. 1%,10%)")
        placement = _placement_factory(args)
        for tiers in tier_sets:
            placement(len(tiers))  # validate now, not after an hour of replay
    except (ValueError, KVTierConfigError) as exc:
        err.print(f"[red]bad arguments[/red] {escape(str(exc))}", soft_wrap=True)
        return 2

    if budget is not None:  # the reader assumed a quarter of the blocks resident; the capacities say now
        resident = max([*capacities, *map(sum, tier_sets)])
        distinct = trace.distinct_blocks
        try:
            check_replay_memory(args.trace, len(trace.requests), trace.references, distinct,
                                min(resident, distinct), budget)
        except TraceTooLargeError as exc:
            err.print(f"[red]trace too large[/red] {escape(str(exc))} (or smaller capacities, or "
                      f"--no-memory-check)", soft_wrap=True)
            return 2

    runs = plan_runs(args.policy, capacities, tier_sets, with_min=not args.no_min)
    if args.no_progress:
        results = run_all(trace, runs, placement, bytes_per_token=args.bytes_per_token)
    else:
        total = trace.references * len(runs)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True) as progress:
            task = progress.add_task("replay", total=total)
            finished = [0]
            last = [0]

            def tick(done: int, label: str) -> None:
                if done < last[0]:
                    finished[0] += last[0]
                last[0] = done
                progress.update(task, completed=finished[0] + done, description=f"replay {label}")

            results = run_all(trace, runs, placement, bytes_per_token=args.bytes_per_token, progress=tick)

    if args.json:
        print(json.dumps(results_json(trace, results), indent=2))
    else:
        out = Console(width=max(Console().width, 150))
        out.print(results_table(trace, results))
        out.print(f"default policy: [bold]{DEFAULT_EVICTION}[/bold]; prefix-hit tokens = input tokens of the "
                  f"leading cached blocks of each request / all input tokens; min = Belady's MIN under the "
                  f"replay's rules (every miss stored; the ceiling gap-closed figures use), belady = Belady "
                  f"with bypass (block-hit optimum)")
        note = trace_note(trace)["note"]
        if note is not None:
            out.print(f"[bold yellow]note:[/bold yellow] {escape(note)}")
    if args.plot:
        path = plot_results(trace, results, args.plot)
        (err if args.json else Console()).print(f"plot written to {escape(str(path))}")
    return 0
