"""The ``kvtier`` command: ``demo``, ``check``, ``stats`` and ``replay``.

Thin: parses arguments, calls the library, prints with rich (text from configs, paths and errors is
escaped, never read as markup). Exit codes: 0 ok, 1 the job failed (e.g. a verification mismatch),
2 bad usage or config. ``--help``, ``--version`` and ``check`` never import torch.

One module (about 500 lines) because the commands share their argument types, the problem printing
and the parser; ``replay``, the largest, lives in :mod:`kvtier.cli_replay`.
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
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.cli_replay import add_replay_parser
from kvtier.errors import KVTierConfigError

console = Console(width=max(Console().width, 120))


def _gib(n: int) -> str:
    if n >= 1 << 40:
        return f"{n / (1 << 40):.2f} TiB"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20 or n == 0:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 10):.1f} KiB" if n >= 1 << 10 else f"{n} B"


def say_problem(label: str, detail: str = "", out: Console | None = None) -> None:
    """``label`` in red, then ``detail`` as plain text on one line: brackets in paths and messages are
    never markup."""
    (out or console).print(f"[red]{escape(label)}[/red]" + (f" {escape(detail)}" if detail else ""),
                           soft_wrap=True)


def say_config_error(source: str, exc: KVTierConfigError, out: Console | None = None) -> None:
    """Every problem of a config, one per line."""
    problems = exc.problems
    say_problem("invalid config", f"{source}: {len(problems)} problem{'s' if len(problems) > 1 else ''}", out)
    for problem in problems:
        (out or console).print(f"  {escape(problem)}", soft_wrap=True)


def cmd_check(args: argparse.Namespace) -> int:
    from kvtier.config import load_config, read_config_mapping

    try:
        cfg = load_config(args.config, engine_supplies_model=args.vllm)
    except KVTierConfigError as exc:
        say_config_error(args.config, exc)
        if not args.vllm and any(p.startswith("model:") for p in exc.problems):
            console.print("  (a tiers-only config for vLLM's connector? "
                          "`kvtier check --vllm FILE` checks it as one)")
        return 2
    console.print(f"[green]ok[/green] {escape(args.config)}"
                  + (" (for the vLLM connector)" if args.vllm else ""))
    raw = read_config_mapping(args.config)
    for line in check_report(cfg, vllm=args.vllm, model_given="model" in raw,
                             engine_keys=[k for k in ("hash_block_size", "block_size", "groups")
                                          if k in raw]):
        console.print(line)
    return 0


def check_report(cfg: Any, *, vllm: bool, model_given: bool, engine_keys: Sequence[str]) -> list[Any]:
    """What ``kvtier check`` prints for a valid config: model, groups, tiers, placement, then warnings."""
    from kvtier.config import namespace_for, plan_groups, redact_url, tier_name
    from kvtier.hostinfo import cuda_present

    out: list[Any] = []
    warnings: list[str] = []
    factor, plans = plan_groups(cfg)
    ns = namespace_for(cfg, [(p.group_id, p.geometry) for p in plans])
    set_bytes = sum(p.geometry.nbytes for p in plans)
    m = cfg.model
    if vllm:
        out.append("model, KV-cache groups, block sizes and TP rank: from the vLLM engine at start-up"
                   + (" (the model section given here must agree with it, and its name names the namespace)"
                      if model_given else ""))
        for key in engine_keys:
            warnings.append(f"{key}: set by the vLLM engine; "
                            + ("set block_size (or blocks_per_chunk) in kv_connector_extra_config "
                               "and remove it here, or start-up fails unless it matches"
                               if key == "block_size" else
                               "the value here is replaced at start-up"))
    else:
        out.append(escape(f"model {m.name}: {m.num_layers} layers, {m.num_kv_heads} KV heads, "
                          f"head_dim {m.head_dim}, {m.dtype}{' (MLA)' if m.mla else ''}, "
                          f"TP rank {m.tp_rank}/{m.tp_size}; namespace {ns.id}"))
        out.append(f"hash_block_size {cfg.hash_block_size}, block_size_factor {factor}")
        groups = Table("group", "name", "GPU block", "offloaded block", "bytes/block", "layout")
        for p in plans:
            groups.add_row(str(p.group_id), escape(p.name), f"{p.gpu_block_size} tok",
                           f"{p.geometry.block_size} tok", _gib(p.geometry.nbytes), p.geometry.describe())
        out.append(groups)
    cuda = cuda_present()
    from kvtier.kernels import host  # (numpy, no torch: `kvtier check` stays light)
    from kvtier.tiers.redis.protocol import native_refusal

    tiers = Table("#", "tier", "type", "capacity", "blocks/group", "eviction", "admission", "where")
    for i, t in enumerate(cfg.tiers):
        name = escape(tier_name(t, i))
        if t.type == "redis":
            where = ", ".join(t.startup_nodes or []) if t.cluster else redact_url(t.url or "")
            tls = (t.url or "").startswith("rediss://") or t.tls_ca_file is not None
            why = native_refusal(t.compression, tls)
            where += ", native client" if why is None else f", Python client ({why})"
            tiers.add_row(str(i), name, "redis" + (" cluster" if t.cluster else ""),
                          "server maxmemory", "-", "server", t.admission, escape(where))
            continue
        blocks = "from the engine" if vllm else str(t.capacity // set_bytes)
        if t.type == "file":
            why = host.unavailable_reason or "xxhash exports no XXH3 functions"
            where = t.path + (", native warm reads" if host.reads_available()
                              else f", reads in Python ({why})")
        elif t.type == "gpu":
            where = f"cuda:{t.device}" + ("" if cuda
                                          else " (no CUDA here: this tier cannot start on this machine)")
        else:
            where = "pinned host memory" if t.pinned is not False and cuda else "host memory"
            if t.pinned is True and not cuda:
                where += " (pinned: true, but no CUDA here)"
            if t.streaming_stores:  # builds the helper if this machine has not yet (once, ~0.1 s)
                where += (", streaming stores" if host.available()
                          else f", memcpy stores (no streaming: {host.unavailable_reason})")
        tiers.add_row(str(i), name, t.type, _gib(t.capacity), blocks, t.eviction, t.admission, escape(where))
    out.append(tiers)
    p = cfg.placement
    out.append(f"placement: {p.write_mode}, promote_on_hit={p.promote_on_hit} (to tier {p.promote_to}), "
               f"keep_lower_copy={p.keep_lower_copy}")
    warnings += capacity_warnings(cfg, None if vllm else ns.id)
    out += [f"[yellow]warning[/yellow] {escape(w)}" for w in warnings]
    return out


def capacity_warnings(cfg: Any, namespace: str | None) -> list[str]:
    """Capacities this machine cannot hold now: memory tiers over available memory, file tiers over free disk.

    A file tier's blocks already on disk count as room it has: those of ``namespace``'s directory, or
    everything under its path where the namespace is not known yet (a config for vLLM). File tiers on
    one filesystem are added up.
    """
    from kvtier.hostinfo import available_memory, bytes_under, free_disk

    warnings = []
    memory_tiers = [(i, t) for i, t in enumerate(cfg.tiers) if t.type == "cpu"]
    memory = sum(t.capacity for _, t in memory_tiers)
    available = available_memory()
    if memory_tiers and available is not None and memory > available:
        names = ", ".join(f"tiers[{i}].capacity" for i, _ in memory_tiers)
        warnings.append(f"{names}: {_gib(memory)} is more than the {_gib(available)} of memory available "
                        f"now; the tier fails to start or the host swaps")
    per_fs: dict[int, list[tuple[int, Any, Path, int, int]]] = {}
    for i, t in enumerate(cfg.tiers):
        if t.type != "file":
            continue
        try:
            where, free = free_disk(t.path)
            device = os.stat(where).st_dev
        except OSError:
            continue  # the path's problem is reported when the tier starts
        stored = bytes_under(Path(t.path) / namespace if namespace else t.path)
        per_fs.setdefault(device, []).append((i, t, where, free, stored))
    for tiers in per_fs.values():
        capacity = sum(t.capacity for _, t, _, _, _ in tiers)
        room = tiers[0][3] + sum(stored for *_, stored in tiers)
        if capacity > room:
            names = ", ".join(f"tiers[{i}].capacity" for i, *_ in tiers)
            warnings.append(f"{names}: {_gib(capacity)} is more than the {_gib(room)} free on the "
                            f"filesystem of {tiers[0][2]} (counting the blocks already stored); the disk "
                            f"fills before the capacity does")
    return warnings


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtier.cache import TieredCache
    from kvtier.config import read_config_mapping
    from kvtier.demo import chat_workload, default_config, make_workdir, run_demo

    config: Any = None
    if args.config:
        try:
            config = read_config_mapping(args.config)
            if args.dir:
                config = place_file_tiers(config, Path(args.dir))
        except KVTierConfigError as exc:
            say_config_error(args.config, exc)
            return 2
    try:
        workdir, temporary = make_workdir(args.dir)
    except OSError as exc:
        say_problem("--dir", f"cannot use {args.dir}: {exc.strerror or exc}")
        return 2
    try:
        if config is None:
            config = default_config(workdir)
            if temporary:  # the directory is deleted afterwards: writing memory blocks down would be wasted
                config["placement"]["persist_on_close"] = False
        try:
            cache = TieredCache.from_config(config)
        except KVTierConfigError as exc:
            say_config_error(args.config or "the built-in demo config", exc)
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
                console.print(escape(f"  tier {tier.name} ({tier.kind}): "
                                     f"{_gib(sum(tier.capacity_bytes.values()))}"
                                     + (f" at {tier.root}" if hasattr(tier, "root") else "")))
            with Progress(TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=False, disable=args.quiet) as bar:
                task = bar.add_task("requests", total=len(prompts))
                result = run_demo(cache, prompts, progress=lambda: bar.advance(task))
            stats = cache.stats()
        table = Table(title="kvtier demo: what each tier did")
        for col in ("tier", "hits", "stored", "evicted", "demoted", "promoted", "read", "written", "used",
                    "errors"):
            table.add_column(col, justify="left" if col == "tier" else "right")
        for t in stats.tiers:
            errors = sum(t.errors.values()) + t.corrupt_or_lost
            table.add_row(escape(f"{t.name} ({t.kind})"), str(t.hits), str(t.stores), str(t.evictions),
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
        console.print(f"[green]bit-exact[/green]: all {result.blocks_verified} loaded blocks matched "
                      f"what was stored, byte for byte")
        for trace_path in args.trace:
            if (code := _demo_policies(trace_path, args.plot_dir)) != 0:
                return code
        return 0
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def place_file_tiers(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``kvtier demo --config X --dir D``: each file tier of X is moved to ``D/<tier name>``.

    So a config meant for a real NVMe path can be tried without touching that path. A config without
    a file tier has nothing to put there: that is an error, not a silently ignored flag.
    """
    tiers = config.get("tiers")
    if not isinstance(tiers, list) or not any(isinstance(t, dict) and t.get("type") == "file" for t in tiers):
        raise KVTierConfigError("--dir", "the config has no file tier to put there; "
                                         "remove --dir, or add a file tier")
    moved = []
    for i, t in enumerate(tiers):
        if isinstance(t, dict) and t.get("type") == "file":
            name = t.get("name") or "file"
            if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
                raise KVTierConfigError(f"tiers[{i}].name", f"{name!r} cannot name a directory under --dir")
            t = {**t, "path": str(directory / name)}
        moved.append(t)
    return {**config, "tiers": moved}


def _demo_policies(trace_path: str, plot_dir: str | None) -> int:
    """The eviction-policy table of one trace (the default beside LRU, ARC, SIEVE, leaf-first LRU and
    both ceilings, at 1-25 % of its distinct blocks), and its plot when ``plot_dir`` is given."""
    from kvtier.demo import DEMO_POLICIES, POLICY_CAPACITIES
    from kvtier.hostinfo import available_memory
    from kvtier.replay import (
        parse_capacity,
        plan_runs,
        plot_results,
        results_table,
        run_all,
        trace_note,
    )
    from kvtier.traces import TraceFormatError, TraceTooLargeError, read_trace

    try:
        trace = read_trace(trace_path, memory_budget=available_memory())  # the demo's capacities: ≤ 25 %
    except TraceTooLargeError as exc:
        console.print(f"[red]trace too large[/red] {escape(str(exc))}; or use `kvtier replay` with it")
        return 2
    except (TraceFormatError, ValueError) as exc:
        console.print(f"[red]bad trace[/red] {exc}")
        return 2
    capacities = [parse_capacity(c, trace.distinct_blocks) for c in POLICY_CAPACITIES]
    console.print(f"replaying {trace.name} through {', '.join(DEMO_POLICIES)} and the ceilings "
                  f"(a few minutes for a long trace) ...")
    results = run_all(trace, plan_runs(DEMO_POLICIES, capacities), lambda n: None)
    Console(width=max(console.width, 170)).print(results_table(trace, results))
    if (note := trace_note(trace)["note"]) is not None:
        console.print(f"[bold yellow]note:[/bold yellow] {escape(note)}")
    if plot_dir:
        path = plot_results(trace, results, Path(plot_dir) / f"policies_{Path(trace_path).stem}.png")
        console.print(f"plot written to {path}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Per-tier figures of a running process (its metrics endpoint) or of a file-tier directory."""
    from urllib.parse import urlsplit

    if args.url and (urlsplit(args.url).scheme not in ("http", "https") or not urlsplit(args.url).netloc):
        say_problem("--url", "expected a metrics endpoint like http://127.0.0.1:9400/metrics, "
                             f"got {args.url!r}")
        return 2
    rows = _stats_from_url(args.url) if args.url else _stats_from_dir(Path(args.dir))
    if rows is None:
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        console.print(f"no file-tier blocks under {escape(args.dir)}" if args.dir else "nothing found")
        return 0
    table = Table(*rows[0].keys())
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else escape(str(v)) for v in row.values()))
    console.print(table)
    return 0


def _stats_from_url(url: str) -> list[dict[str, Any]] | None:
    from urllib.error import URLError
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (URLError, OSError, ValueError) as exc:
        say_problem(f"cannot read {url}", str(exc))
        return None
    per_tier: dict[str, dict[str, Any]] = {}
    wanted = {"kvtier_tier_hits": "hits", "kvtier_tier_misses": "misses", "kvtier_tier_stores": "stores",
              "kvtier_tier_evictions": "evictions",
              "kvtier_tier_demotions_out": "demoted", "kvtier_tier_promotions_in": "promoted",
              "kvtier_tier_bytes_read": "bytes read", "kvtier_tier_bytes_written": "bytes written",
              "kvtier_tier_usage_bytes": "used bytes", "kvtier_tier_capacity_bytes": "capacity bytes",
              "kvtier_tier_errors": "errors"}
    try:
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
    except (ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        say_problem(f"{url} is not a Prometheus metrics endpoint",
                    f"({type(exc).__name__}: {detail[:80]}{'…' if len(detail) > 80 else ''})")
        return None
    if not per_tier:
        say_problem(f"no kvtier metrics at {url}",
                    "(a kvtier process serves them at metrics.port, path /metrics)")
        return None
    return list(per_tier.values())


def _tier_roots(root: Path, depth: int = 2) -> list[Path]:
    """``root`` if it is a file tier's ``path`` (namespace directories holding ``g<N>`` groups), else such
    directories up to ``depth`` levels below it (``kvtier demo --dir D`` puts its tier in
    ``D/kvtier-files``)."""
    def is_tier_root(path: Path) -> bool:
        try:
            return any(ns.is_dir() and not ns.is_symlink()
                       and any(g.is_dir() and g.name[:1] == "g" and g.name[1:].isdigit()
                               for g in ns.iterdir())
                       for ns in path.iterdir())
        except OSError:
            return False

    if is_tier_root(root):
        return [root]
    if depth == 0:
        return []
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    return [found for child in children for found in _tier_roots(child, depth - 1)]


def _stats_from_dir(root: Path) -> list[dict[str, Any]] | None:
    """Blocks and bytes per namespace and group under a file tier's ``path`` (read-only walk)."""
    from kvtier.tiers.file import BLOCK_SUFFIX

    if not root.is_dir():
        say_problem("not a directory", str(root))
        return None
    rows = []
    for tier_root in _tier_roots(root):
        for ns in sorted(p for p in tier_root.iterdir() if p.is_dir() and not p.is_symlink()):
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
                row = {"namespace": ns.name, "group": group.name[1:], "blocks": blocks, "bytes on disk": size}
                if tier_root != root:
                    row = {"path": str(tier_root.relative_to(root)), **row}
                rows.append(row)
    return rows


def positive_int(text: str) -> int:
    """argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def directory_arg(text: str) -> str:
    """argparse type: a directory, or a path where one can be made (not an existing file)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache storage for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo",
                          help="run a multi-turn chat workload through a two-tier cache and verify it")
    demo.add_argument("--config", help="YAML config to run on (default: embedded CPU + file tiers)")
    demo.add_argument("--dir", type=directory_arg,
                      help="directory for the file tier (default: a temporary one, removed); with --config, "
                           "each file tier of the config goes to DIR/<tier name> instead of its path")
    demo.add_argument("--conversations", type=positive_int, default=16)
    demo.add_argument("--turns", type=positive_int, default=4, help="requests per conversation")
    demo.add_argument("--system-tokens", type=non_negative_int, default=512)
    demo.add_argument("--turn-tokens", type=positive_int, default=128)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--trace", nargs="*", default=[], metavar="TRACE",
                      help="then replay each trace (Mooncake or generic JSONL, Azure or BurstGPT CSV; "
                           "plain or compressed) through the eviction policies and print their table (e.g. "
                           "$KVTIER_TRACES/*.jsonl; "
                           "docs/traces.md)")
    demo.add_argument("--plot-dir", help="with --trace: write each trace's plot there")
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser("check", help="validate a config and print the resolved tiers")
    check.add_argument("config", help="YAML file")
    check.add_argument("--vllm", action="store_true",
                       help="the config is for vLLM's connector: model, groups and block sizes come from the "
                            "engine, so a tiers-only config is complete (docs/vllm.md)")
    check.set_defaults(func=cmd_check)

    stats = sub.add_parser("stats", help="per-tier figures of a running process or a file-tier directory")
    where = stats.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a process's metrics endpoint (config `metrics.port`), e.g. "
                                     "http://127.0.0.1:9400/metrics")
    where.add_argument("--dir",
                       help="a file tier's `path`, or a directory holding one (e.g. `kvtier demo --dir`'s)")
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
