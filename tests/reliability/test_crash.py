"""Crash: a child process writing to a file tier is killed with SIGKILL at a random moment, repeatedly.

The child writes 256 KiB blocks as fast as it can (so a kill almost always lands inside a write, a
rename or a delete) and appends one line per acknowledged block, and one per delete it starts, to a
log. After each kill a new process (this one) opens the directory, and the test checks:

- no temporary file is left (the dead writer's are removed at start-up) and the index equals the
  block files on disk;
- every indexed block reads back bit-exact (so the index holds only complete, checksum-valid blocks);
- every block acknowledged to the dead child and not deleted after is still there: a process crash
  (unlike a power cut) loses nothing acknowledged, even with ``fsync: false``.

Half of the rounds kill a child running the whole cache (CPU tier in front, demotions into the file
tier), which must come back with a consistent index as well.

What this cannot show: a power cut. With ``fsync: false`` a block acknowledged before the cut may
be missing after it (never wrong: rename makes a file visible only when complete, and the header,
length and checksum are validated again on every read).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvtier import TieredCache
from kvtier.layout import BlockLayout
from kvtier.tiers.file import FileTier
from tests.reliability.conftest import (
    FaultRow,
    Oracle,
    consistency_problems,
    expected_bytes,
    files_on_disk,
    record,
    universe,
)

REPO = Path(__file__).resolve().parents[2]
#: 8 layers × 2 × 16 tokens × 4 heads × 128 fp16 = 256 KiB: writes long enough for kills to land inside
BIG = BlockLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16)
BIG_MODEL = {"name": "crash-model", "num_layers": 8, "num_kv_heads": 4, "head_dim": 128, "dtype": "float16"}
NAMESPACE = "crash"


def crash_config(root: Path) -> dict[str, object]:
    return {"model": BIG_MODEL, "hash_block_size": 16,
            "tiers": [{"type": "cpu", "capacity": 4 * BIG.nbytes},
                      {"type": "file", "path": str(root), "capacity": 24 * BIG.nbytes}]}


def crash_child(mode: str, root: str, log_path: str, seed: int) -> None:
    """The process that gets killed: writes blocks forever, logging acks (``p <hex>``) and deletes
    (``d <hex>``)."""
    keys = universe(48, tag="crash")
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def log(lines: list[str]) -> None:
        if lines:
            os.write(fd, "".join(f"{line}\n" for line in lines).encode())

    if mode == "tier":
        tier = FileTier("file", {0: BIG}, {0: 1 << 40}, root=root, namespace=NAMESPACE)
        blocks = {k: expected_bytes(k, BIG.nbytes) for k in keys}  # made once: the loop is all I/O
        log(["ready"])

        async def forever() -> None:
            while True:
                batch = list(dict.fromkeys(rng.sample(keys, rng.randint(1, 8))))
                if rng.random() < 0.2:
                    log([f"d {k.block_hash.hex()}" for k in batch])
                    await tier.delete(batch)
                    continue
                done = await tier.put(batch, [blocks[k] for k in batch])
                log([f"p {k.block_hash.hex()}" for k, ok in zip(batch, done, strict=True) if ok])

        asyncio.run(forever())
    oracle = Oracle(BIG)
    with TieredCache.from_config(crash_config(Path(root))) as cache:
        log(["ready"])
        while True:
            start = rng.randrange(len(keys))
            run = keys[start:start + rng.randint(1, 6)]
            if rng.random() < 0.6:
                if oracle.store(cache, run) == len(run):
                    log([f"p {k.block_hash.hex()}" for k in run])
            else:
                oracle.load(cache, run)
                if oracle.wrong:
                    log(["WRONG"])


def _kill_one(mode: str, root: Path, log_path: Path, seed: int, rng: random.Random) -> float:
    """Start a child, wait until it writes, SIGKILL it after a random delay; return the delay."""
    code = f"from tests.reliability.test_crash import crash_child; crash_child({mode!r}, {str(root)!r}, " \
           f"{str(log_path)!r}, {seed})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not (log_path.exists() and "ready" in log_path.read_text()):
            if child.poll() is not None:
                raise AssertionError(f"the crash child exited early: {child.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "the crash child never became ready"
            time.sleep(0.02)
        delay = rng.uniform(0.05, 0.6)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
        if child.stderr is not None:
            child.stderr.close()
    return delay


def _acked_and_kept(log_text: str) -> set[bytes]:
    """Keys whose last complete log line is an ack (a delete started after the ack may have happened)."""
    last: dict[str, str] = {}
    for line in log_text.split("\n")[:-1]:  # the part after the last newline may be torn
        op, _, hex_hash = line.partition(" ")
        if op in ("p", "d"):
            last[hex_hash] = op
    return {bytes.fromhex(h) for h, op in last.items() if op == "p"}


def scenario_crash(workdir: Path, rounds: int, seed: int = 0) -> tuple[FaultRow, list[str]]:
    root = workdir / "crash-files"
    rng = random.Random(seed)
    problems: list[str] = []
    restart_seconds = 0.0
    temps_seen = acked_total = read_back = 0
    for r in range(rounds):
        mode = "tier" if r % 2 == 0 else "cache"
        log_path = workdir / f"child-{r}.log"
        _kill_one(mode, root, log_path, seed * 100 + r, rng)
        text = log_path.read_text()
        if "WRONG" in text:
            problems.append(f"round {r}: the child loaded a wrong block before it was killed")
        temps_seen += sum(1 for _ in root.rglob("*.tmp"))
        started = time.monotonic()
        tier = FileTier("file", {0: BIG}, {0: 1 << 40}, root=root, namespace=NAMESPACE)
        restart_seconds = max(restart_seconds, time.monotonic() - started)
        try:
            indexed = set(tier.keys())
            on_disk, temps = files_on_disk(tier)
            if temps:
                problems.append(f"round {r}: temporary files survived the restart: {temps[:3]}")
            if on_disk != indexed:
                problems.append(f"round {r}: index and disk differ after restart")
            keys = sorted(indexed)
            out = [torch.empty(BIG.nbytes, dtype=torch.uint8) for _ in keys]
            hits = asyncio.run(tier.get(keys, out)) if keys else []
            read_back += sum(hits)
            for key, hit, buf in zip(keys, hits, out, strict=True):
                if not hit:
                    problems.append(f"round {r}: indexed block {key} did not read back")
                elif not torch.equal(buf, expected_bytes(key, BIG.nbytes)):
                    problems.append(f"round {r}: indexed block {key} has wrong bytes")
            if mode == "tier":
                kept = _acked_and_kept(text)
                acked_total += len(kept)
                lost = kept - {k.block_hash for k in indexed}
                if lost:
                    problems.append(f"round {r}: {len(lost)} acknowledged blocks lost by a process crash")
        finally:
            asyncio.run(tier.close())
    oracle = Oracle(BIG)
    with TieredCache.from_config(crash_config(root)) as cache:  # the cache comes back consistent too
        problems += consistency_problems(cache)
        oracle.sweep(cache, universe(48, tag="crash"))
        problems += consistency_problems(cache)
    row = FaultRow(f"SIGKILL while writing the file tier ({rounds} kills)",
                   operations=acked_total + oracle.operations,
                   verified=read_back + oracle.verified, wrong=oracle.wrong, errors=len(oracle.errors),
                   recover_seconds=restart_seconds, max_call_seconds=oracle.max_latency,
                   notes=[f"{temps_seen} temporary files found after kills, all removed at restart; "
                          f"{acked_total} acknowledged blocks checked present; "
                          "recovery = restart index scan"])
    return row, problems


def test_sigkill_while_writing_leaves_only_complete_blocks(tmp_path: Path) -> None:
    row, problems = scenario_crash(tmp_path, rounds=6)
    record(row)
    assert row.wrong == 0 and row.errors == 0, row
    assert not problems, problems
    assert row.verified > 0


def test_restart_keeps_a_live_writers_temp_files_and_drops_damaged_ones(tmp_path: Path) -> None:
    """Planted leftovers: a dead writer's temp file goes, a live one's stays; a torn file goes; a file
    whose payload rotted after it was written stays indexed (only the header page is read at start-up)
    and becomes a miss — and is deleted — on its first read."""
    tier = FileTier("file", {0: BIG}, {0: 1 << 40}, root=tmp_path, namespace=NAMESPACE)
    keys = universe(3, tag="planted")
    assert asyncio.run(tier.put(keys, [expected_bytes(k, BIG.nbytes) for k in keys])) == [True] * 3
    asyncio.run(tier.close())
    shard = tier.path_of(keys[0]).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (shard / f".{'ab' * 16}.{dead.pid}.00000000.tmp").write_bytes(b"x" * 4096)
    live = shard / f".{'cd' * 16}.{os.getppid()}.00000000.tmp"
    live.write_bytes(b"x" * 4096)
    torn = tier.path_of(keys[1])
    os.truncate(torn, torn.stat().st_size - 4096)
    rotten = tier.path_of(keys[2])
    with open(rotten, "r+b") as f:
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    again = FileTier("file", {0: BIG}, {0: 1 << 40}, root=tmp_path, namespace=NAMESPACE)
    try:
        assert set(again.keys()) == {keys[0], keys[2]}
        assert live.exists() and not any(p.name.startswith(f".{'ab' * 16}") for p in shard.iterdir())
        out = [torch.empty(BIG.nbytes, dtype=torch.uint8) for _ in range(2)]
        assert asyncio.run(again.get([keys[0], keys[2]], out)) == [True, False]
        assert torch.equal(out[0], expected_bytes(keys[0], BIG.nbytes))
        assert set(again.keys()) == {keys[0]} and not rotten.exists()
    finally:
        live.unlink()
        asyncio.run(again.close())
