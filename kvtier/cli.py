"""The ``kvtier`` command: ``demo``, ``check``, ``stats`` and ``replay``.

Thin: parses arguments, calls the library, prints with rich. Exit codes: 0 ok, 1 the job failed
(e.g. a verification mismatch), 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.cli_replay import add_replay_parser
from kvtier.errors import KVTierConfigError

console = Console(width=max(Console().width, 120))


def _gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def cmd_check(args: argparse.Namespace) -> int:
    from kvtier.config import build_namespace, build_spec, load_config, redact_url, split_capacity, tier_name

    try:
        cfg = load_config(args.config)
    except KVTierConfigError as exc:
        console.print(f"[red]invalid config[/red] {args.config}: {exc}")
        return 2
    spec = build_spec(cfg)
    ns = build_namespace(cfg, spec)
    m = cfg.model
    console.print(f"[green]ok[/green] {args.config}")
    console.print(f"model {m.name}: {m.num_layers} layers, {m.num_kv_heads} KV heads, head_dim {m.head_dim}, "
                  f"{m.dtype}{' (MLA)' if m.mla else ''}, TP rank {m.tp_rank}/{m.tp_size}; namespace {ns.id}")
    console.print(f"hash_block_size {spec.hash_block_size}, block_size_factor {spec.block_size_factor}")
    groups = Table("group", "name", "GPU block", "offloaded block", "bytes/block", "layout")
    for g in spec.groups:
        groups.add_row(str(g.group_id), g.name, f"{g.gpu_block_size} tok", f"{g.offloaded_block_size} tok",
                       _gib(g.layout.nbytes), g.layout.describe())
    if not spec.groups:
        console.print("no KV-cache groups: kvtier will store nothing")
    else:
        console.print(groups)
    tiers = Table("#", "tier", "type", "capacity", "blocks/group", "eviction", "admission", "where")
    for i, t in enumerate(cfg.tiers):
        if t.type == "redis":
            where = ", ".join(t.startup_nodes or []) if t.cluster else redact_url(t.url or "")
            tiers.add_row(str(i), tier_name(t, i), "redis" + (" cluster" if t.cluster else ""),
                          "server maxmemory", "-", "server", t.admission, where)
            continue
        shares = split_capacity(t.capacity, spec)
        blocks = ", ".join(str(shares[g.group_id] // g.layout.nbytes) for g in spec.groups)
        where = getattr(t, "path", "pinned host memory" if getattr(t, "pinned", "auto") is not False else "host memory")
        tiers.add_row(str(i), tier_name(t, i), t.type, _gib(t.capacity), blocks, t.eviction, t.admission, where)
    console.print(tiers)
    p = cfg.placement
    console.print(f"placement: {p.write_mode}, promote_on_hit={p.promote_on_hit} (to tier {p.promote_to}), "
                  f"keep_lower_copy={p.keep_lower_copy}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtier.cache import TieredCache
    from kvtier.demo import chat_workload, default_config, make_workdir, run_demo

    workdir, temporary = make_workdir(args.dir)
    try:
        config: Any = args.config or default_config(workdir)
        try:
            cache = TieredCache.from_config(config)
        except KVTierConfigError as exc:
            console.print(f"[red]invalid config[/red]: {exc}")
            return 2
        with cache:
            if not cache.spec.groups:
                console.print("the model has no KV-cache groups: nothing to demo")
                return 0
            layout = cache.spec.groups[0].layout
            prompts = chat_workload(args.conversations, args.turns, args.system_tokens, args.turn_tokens,
                                    seed=args.seed)
            console.print(f"kvtier demo: {len(prompts)} requests from {args.conversations} conversations, "
                          f"{layout.describe()} = {_gib(layout.nbytes)} per block")
            for tier in cache.core.tiers:
                console.print(f"  tier {tier.name} ({tier.kind}): {_gib(sum(tier.capacity_bytes.values()))}"
                              + (f" at {tier.root}" if hasattr(tier, "root") else ""))
            with Progress(TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=False, disable=args.quiet) as bar:
                task = bar.add_task("requests", total=len(prompts))
                result = run_demo(cache, prompts, progress=lambda: bar.advance(task))
            stats = cache.stats()
        table = Table(title="kvtier demo: what each tier did")
        for col in ("tier", "hits", "stored", "evicted", "demoted", "promoted", "read", "written", "used", "errors"):
            table.add_column(col, justify="left" if col == "tier" else "right")
        for t in stats.tiers:
            errors = sum(t.errors.values()) + t.corrupt_or_lost
            table.add_row(f"{t.name} ({t.kind})", str(t.hits), str(t.stores), str(t.evictions),
                          str(t.demotions_out), str(t.promotions_in),
                          f"{_gib(t.bytes_read)} @ {t.read_gbps:.2f} GB/s",
                          f"{_gib(t.bytes_written)} @ {t.write_gbps:.2f} GB/s",
                          f"{t.usage_bytes / t.capacity_bytes:.0%}" if t.capacity_bytes else "-", str(errors))
        misses = result.prompt_tokens // layout.block_size - result.blocks_loaded
        table.add_row("miss (computed)", str(misses), *([""] * 8))
        console.print(table)
        ratio = result.hit_tokens / result.prompt_tokens if result.prompt_tokens else 0.0
        console.print(f"{result.requests} requests in {result.seconds:.1f} s; prefix hits {ratio:.1%} of "
                      f"{result.prompt_tokens:,} prompt tokens; {result.blocks_stored} blocks stored")
        if result.mismatched_blocks:
            console.print(f"[red]FAIL[/red]: {result.mismatched_blocks} of {result.blocks_verified} loaded "
                          f"blocks differ from what was stored")
            return 1
        console.print(f"[green]bit-exact[/green]: all {result.blocks_verified} loaded blocks matched what was "
                      f"stored, byte for byte")
        for trace_path in args.trace:
            if (code := _demo_policies(trace_path, args.plot_dir)) != 0:
                return code
        return 0
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def _demo_policies(trace_path: str, plot_dir: str | None) -> int:
    """The eviction-policy table of one trace (the default beside LRU, ARC, SIEVE, leaf-first LRU and
    both ceilings, at 1-25 % of its distinct blocks), and its plot when ``plot_dir`` is given."""
    from kvtier.demo import DEMO_POLICIES, POLICY_CAPACITIES
    from kvtier.replay import (
        TraceFormatError,
        parse_capacity,
        plan_runs,
        plot_results,
        read_trace,
        results_table,
        run_all,
    )

    try:
        trace = read_trace(trace_path)
    except (TraceFormatError, ValueError) as exc:
        console.print(f"[red]bad trace[/red] {exc}")
        return 2
    capacities = [parse_capacity(c, trace.distinct_blocks) for c in POLICY_CAPACITIES]
    console.print(f"replaying {trace.name} through {', '.join(DEMO_POLICIES)} and the ceilings "
                  f"(a few minutes for a long trace) ...")
    results = run_all(trace, plan_runs(DEMO_POLICIES, capacities), lambda n: None)
    Console(width=max(console.width, 170)).print(results_table(trace, results))
    if plot_dir:
        path = plot_results(trace, results, Path(plot_dir) / f"policies_{Path(trace_path).stem}.png")
        console.print(f"plot written to {path}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Per-tier figures of a running process (its metrics endpoint) or of a file-tier directory."""
    rows = _stats_from_url(args.url) if args.url else _stats_from_dir(Path(args.dir))
    if rows is None:
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        console.print("nothing found")
        return 0
    table = Table(*rows[0].keys())
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()))
    console.print(table)
    return 0


def _stats_from_url(url: str) -> list[dict[str, Any]] | None:
    from urllib.error import URLError
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (URLError, OSError) as exc:
        console.print(f"[red]cannot read {url}[/red]: {exc}")
        return None
    per_tier: dict[str, dict[str, Any]] = {}
    wanted = {"kvtier_tier_hits": "hits", "kvtier_tier_misses": "misses", "kvtier_tier_stores": "stores", "kvtier_tier_evictions": "evictions",
              "kvtier_tier_demotions_out": "demoted", "kvtier_tier_promotions_in": "promoted",
              "kvtier_tier_bytes_read": "bytes read", "kvtier_tier_bytes_written": "bytes written",
              "kvtier_tier_usage_bytes": "used bytes", "kvtier_tier_capacity_bytes": "capacity bytes",
              "kvtier_tier_errors": "errors"}
    for family in text_string_to_metric_families(text):
        column = wanted.get(family.name)
        if column is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            row = per_tier.setdefault(sample.labels["tier"], {"tier": sample.labels["tier"],
                                                              "kind": sample.labels["kind"]})
            row[column] = row.get(column, 0) + int(sample.value)
    return list(per_tier.values())


def _stats_from_dir(root: Path) -> list[dict[str, Any]] | None:
    """Blocks and bytes per namespace and group under a file tier's ``path`` (read-only walk)."""
    from kvtier.tiers.file import BLOCK_SUFFIX

    if not root.is_dir():
        console.print(f"[red]not a directory[/red]: {root}")
        return None
    rows = []
    for ns in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        for group in sorted(p for p in ns.iterdir() if p.is_dir() and p.name.startswith("g")):
            blocks = size = 0
            for shard in group.iterdir():
                if not shard.is_dir():
                    continue
                with os.scandir(shard) as entries:
                    for entry in entries:
                        if entry.name.endswith(BLOCK_SUFFIX) and entry.is_file(follow_symlinks=False):
                            blocks += 1
                            size += entry.stat(follow_symlinks=False).st_size
            rows.append({"namespace": ns.name, "group": group.name[1:], "blocks": blocks, "bytes on disk": size})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache storage for LLM serving.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a multi-turn chat workload through a two-tier cache and verify it")
    demo.add_argument("--config", help="YAML config to run on (default: embedded CPU + file tiers)")
    demo.add_argument("--dir", help="directory for the default file tier (default: a temporary one, removed)")
    demo.add_argument("--conversations", type=int, default=16)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--system-tokens", type=int, default=512)
    demo.add_argument("--turn-tokens", type=int, default=128)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--trace", nargs="*", default=[], metavar="TRACE",
                      help="then replay each trace (Mooncake or generic JSONL) through the eviction policies and "
                           "print their table (e.g. ../shared/traces/*.jsonl)")
    demo.add_argument("--plot-dir", help="with --trace: write each trace's plot there")
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser("check", help="validate a config and print the resolved tiers")
    check.add_argument("config", help="YAML file")
    check.set_defaults(func=cmd_check)

    stats = sub.add_parser("stats", help="per-tier figures of a running process or a file-tier directory")
    where = stats.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a process's metrics endpoint (config `metrics.port`), e.g. "
                                     "http://127.0.0.1:9400/metrics")
    where.add_argument("--dir", help="a file tier's `path`")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(func=cmd_stats)

    add_replay_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
