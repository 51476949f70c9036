"""Soak: the fault and stress scenarios of ``tests/reliability`` run for minutes, with the same oracle.

Not a benchmark of speed: it runs every scenario of the suite in turn (8 threads on one cache, 2
processes sharing a file directory and a Redis, SIGKILL while writing, ENOSPC/EIO on writes, reads
and renames, a full disk, damaged and deleted files, damaged Redis values, a full Redis, Redis
killed and restarted, a cluster master killed and restarted, the network cut, a server that never
answers, a slow Redis), each run longer than in the test suite and with a new seed, until the time is
up. Every run ends with the oracle's check (every block acknowledged as stored is returned bit-exact
or reported missing) and the state checks (no pins, no pending entries, usage counters equal to what
the tiers hold, the file index equal to the disk). It then prints the fault table — one line per
scenario, figures summed over its runs, the time to recover being the worst run's — and the command
that made it, and exits 1 if any run saw a wrong block, an error surfaced to the caller or a broken
state check.

Usage: ``python benchmarks/soak.py --minutes 10 [--run-seconds 20] [--only PATTERN] [--seed N]``
from the repository root; needs the test extras (``pip install -e '.[test]'``) and, for the Redis
scenarios, ``redis-server`` and ``redis-cli`` on PATH (they are skipped without them; every server is
private, on a free loopback port). The suite's default run (``pytest tests/reliability``) runs each
scenario once for a few seconds; ``KVTIER_FAULT_TABLE=- pytest tests/reliability`` prints its table.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.reliability import (  # noqa: E402 - the repository root must be importable first
    test_concurrency,
    test_crash,
    test_remote_faults,
    test_storage_faults,
)
from tests.reliability.conftest import FaultRow, format_table  # noqa: E402
from tests.tiers.conftest import RedisProcess, free_port, start_cluster  # noqa: E402

Runner = Callable[[Path, float, int], tuple[FaultRow, Any]]


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(free_port(), workdir / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def redis_cluster(workdir: Path) -> Iterator[Any]:
    handle = start_cluster(workdir / "cluster")
    try:
        yield handle
    finally:
        handle.stop()


def _problems(details: Any) -> list[str]:
    if isinstance(details, dict):
        problems = list(details.get("problems", []))
        if details.get("exitcodes", [0]) != [0] * len(details.get("exitcodes", [0])):
            problems.append(f"a child process failed: exit codes {details['exitcodes']}")
        return problems
    return list(details)


def scenarios(with_redis: bool) -> list[tuple[str, Runner]]:
    """(name, runner(workdir, seconds, seed)) for every scenario of the suite."""
    out: list[tuple[str, Runner]] = [
        ("8 threads, cpu+file, inclusive",
         lambda d, t, seed: test_concurrency.scenario_threads(d, t, name="8 threads, cpu+file, inclusive",
                                                              seed=seed)),
        ("8 threads, cpu+file, exclusive promotion",
         lambda d, t, seed: test_concurrency.scenario_threads(d, t,
                                                              name="8 threads, cpu+file, exclusive promotion",
                                                              keep_lower_copy=False, seed=seed)),
        ("SIGKILL while writing the file tier",
         lambda d, t, seed: test_crash.scenario_crash(d, rounds=max(2, int(t // 2.5)), seed=seed)),
        ("bit flips, truncation, forged headers, deletions in files",
         lambda d, t, seed: test_storage_faults.scenario_damaged_files(d, t, seed=seed)),
    ]
    for syscall, error, rate in (("pwritev", "ENOSPC", 0.3), ("pwritev", "EIO", 0.3), ("preadv", "EIO", 0.3),
                                 ("rename", "EIO", 0.3), ("pwritev", "ENOSPC", 1.0)):
        def run(d: Path, t: float, seed: int, syscall: str = syscall, error: str = error,
                rate: float = rate) -> tuple[FaultRow, Any]:
            return test_storage_faults.scenario_syscall_fault(d, t, syscall, error, rate, seed=seed)
        out.append((f"{error} on {syscall} at {rate:.0%}", run))
    if not with_redis:
        return out

    def with_server(body: Callable[[Path, Any, float, int], tuple[FaultRow, Any]]) -> Runner:
        def run(d: Path, t: float, seed: int) -> tuple[FaultRow, Any]:
            with redis_server(d) as server:
                return body(d, server, t, seed)
        return run

    def cluster_node(d: Path, t: float, seed: int) -> tuple[FaultRow, Any]:
        with redis_cluster(d) as handle:
            return test_remote_faults.scenario_cluster_node(handle, t, seed=seed)

    out += [
        ("8 threads, cpu+file+redis, write-through", with_server(
            lambda d, srv, t, seed: test_concurrency.scenario_threads(
                d, t, name="8 threads, cpu+file+redis, write-through", write_mode="write_through",
                redis_url=srv.url, seed=seed))),
        ("2 processes, shared file dir + Redis", with_server(
            lambda d, srv, t, seed: test_concurrency.scenario_two_processes(d, srv.url, t))),
        ("bit flips, truncation, forged headers in Redis values", with_server(
            lambda d, srv, t, seed: test_storage_faults.scenario_damaged_redis_values(srv.url, t,
                                                                                      seed=seed))),
        ("Redis full", with_server(
            lambda d, srv, t, seed: test_storage_faults.scenario_full_redis(srv.url, t, seed=seed))),
        ("Redis killed and restarted", with_server(
            lambda d, srv, t, seed: test_remote_faults.scenario_redis_restart(srv, t, seed=seed))),
        ("Redis Cluster: a master killed and restarted", cluster_node),
        ("network to Redis cut", with_server(
            lambda d, srv, t, seed: test_remote_faults.scenario_network_cut(srv.url, t, seed=seed))),
        ("Redis accepts and never answers",
         lambda d, t, seed: test_remote_faults.scenario_server_never_answers(min(t, 10.0), seed=seed)),
        ("slow Redis, below the timeout", with_server(
            lambda d, srv, t, seed: test_remote_faults.scenario_slow_redis(srv.url, t, 0.05, seed=seed))),
        ("slow Redis, above the timeout", with_server(
            lambda d, srv, t, seed: test_remote_faults.scenario_slow_redis(srv.url, t, 0.8, seed=seed))),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="total time (default 10)")
    parser.add_argument("--run-seconds", type=float, default=20.0,
                        help="length of one run of a scenario (default 20; the test suite uses 2-4)")
    parser.add_argument("--only", default="", help="run the scenarios whose name contains this text")
    parser.add_argument("--seed", type=int, default=1, help="first seed (each run takes the next)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis scenarios")
    args = parser.parse_args(argv)
    with_redis = not args.no_redis and bool(shutil.which("redis-server") and shutil.which("redis-cli"))
    todo = [(n, r) for n, r in scenarios(with_redis) if args.only.lower() in n.lower()]
    if not todo:
        print(f"no scenario matches {args.only!r}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.minutes * 60
    rows: dict[str, FaultRow] = {}
    problems: list[str] = []
    seed = args.seed
    started = time.monotonic()
    while time.monotonic() < deadline or not rows:
        for name, runner in todo:
            left = deadline - time.monotonic()
            if left <= 0 and len(rows) == len(todo):
                break
            run_seconds = max(2.0, min(args.run_seconds, left))
            with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as workdir:
                try:
                    row, details = runner(Path(workdir), run_seconds, seed)
                except Exception as exc:
                    # a scenario that cannot even run is a failure, not a crash of the soak
                    row, details = FaultRow(name, errors=1), [f"{name}: the run failed: {exc!r}"]
            problems += [f"{name} (seed {seed}): {p}" for p in _problems(details)]
            if name in rows:
                rows[name].merge(row)
            else:
                row.scenario = name
                rows[name] = row
            print(f"[{time.monotonic() - started:7.1f} s] {name}: {row.operations:,} ops, "
                  f"{row.verified:,} verified, {row.wrong} wrong, {row.errors} errors", flush=True)
            seed += 1
    table = [FaultRow(f"{r.scenario} (×{r.runs})", r.operations, r.verified, r.wrong, r.errors,
                      r.recover_seconds, r.max_call_seconds,
                      notes=[f"last run: {'; '.join(r.notes)}"] if r.runs > 1 else r.notes)
             for r in rows.values()]
    print()
    print(format_table(table))
    print()
    print(f"{len(rows)} scenarios, {sum(r.runs for r in rows.values())} runs in "
          f"{(time.monotonic() - started) / 60:.1f} min on {platform.node()} ({platform.machine()}, "
          f"Python {platform.python_version()}); time to recover = the worst run's")
    print(f"command: python {shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    if not with_redis:
        print("Redis scenarios skipped (--no-redis, or redis-server/redis-cli not on PATH)")
    bad = [r for r in rows.values() if r.wrong or r.errors]
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if bad or problems:
        print(f"FAIL: {len(bad)} scenarios with wrong blocks or surfaced errors, "
              f"{len(problems)} state problems")
        return 1
    print("ok: no wrong block, no error surfaced, every state check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
