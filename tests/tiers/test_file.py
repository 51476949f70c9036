"""FileTier against real files under pytest's tmp_path: round trips, restarts, damage and faults."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockKey
from kvtier.codec import _CHECKSUM_OFFSET
from kvtier.errors import KVTierConfigError, LayoutMismatch
from kvtier.layout import BlockLayout
from kvtier.tiers import file as file_module
from kvtier.tiers.buffers import aligned_empty
from kvtier.tiers.file import PAGE, FileTier

#: Group 0: 64 KiB blocks (a page multiple); group 1: 1 KiB blocks (padded on disk); group 2: bf16.
LAYOUTS = {
    0: BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64),
    1: BlockLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4),
    2: BlockLayout(num_layers=2, num_kv_heads=1, head_dim=128, block_size=16, dtype=torch.bfloat16),
}
CAPACITY = {g: 1 << 30 for g in LAYOUTS}


def run(coro):
    return asyncio.run(coro)


def make_tier(root: Path, namespace: str = "ns", **kwargs) -> FileTier:
    return FileTier("disk", LAYOUTS, CAPACITY, root=root, namespace=namespace, **kwargs)


def key(i: int, group: int = 0) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 4, group)


def random_block(group: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUTS[group].nbytes,), dtype=torch.uint8, generator=gen)


def kv_like_block(group: int, seed: int) -> torch.Tensor:
    """Compressible bytes shaped like KV values: small fp16/bf16 numbers with few distinct values."""
    layout = LAYOUTS[group]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-4, 5, (layout.numel,), generator=gen).to(layout.dtype) / 8
    return values.view(torch.uint8).clone()


def get_one(tier: FileTier, k: BlockKey) -> tuple[bool, torch.Tensor]:
    out = torch.empty(LAYOUTS[k.group_id].nbytes, dtype=torch.uint8)
    ok = run(tier.get([k], [out]))
    return ok[0], out


def files_under(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_file()}


def keys_on_disk(tier: FileTier) -> set[BlockKey]:
    found = set()
    for path in tier.directory.rglob("*.kvb"):
        found.add(BlockKey(bytes.fromhex(path.stem), int(path.parent.parent.name[1:])))
    return found


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("direct_reads", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
def test_round_trip_is_bit_exact(tmp_path: Path, compression: str, direct_reads: bool, aligned: bool) -> None:
    tier = make_tier(tmp_path, compression=compression, direct_reads=direct_reads)
    keys = [key(i, g) for g in LAYOUTS for i in range(3)]
    make = kv_like_block if compression == "lz4" else random_block
    blocks = [make(k.group_id, n) for n, k in enumerate(keys)]
    if aligned:
        blocks = [aligned_empty(b.numel()).copy_(b) for b in blocks]
    assert run(tier.put(keys, blocks)) == [True] * len(keys)
    out = [aligned_empty(b.numel()) if aligned else torch.empty_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * len(keys)
    for block, got in zip(blocks, out, strict=True):
        assert torch.equal(block, got)
    assert run(tier.contains(keys + [key(99)])) == [True] * len(keys) + [False]
    assert set(tier.keys()) == set(keys)
    assert tier.usage_bytes() == sum(3 * layout.nbytes for layout in LAYOUTS.values())
    assert tier.counters.blocks_written == tier.counters.blocks_read == len(keys)
    assert tier.counters.errors == {}
    for k in keys:
        size = tier.path_of(k).stat().st_size
        assert size % PAGE == 0
        raw_size = PAGE + -(-LAYOUTS[k.group_id].nbytes // PAGE) * PAGE
        if compression == "none" or raw_size == 2 * PAGE:  # a one-page payload cannot shrink on disk
            assert size == raw_size
        else:
            assert size < raw_size
    run(tier.close())


def test_overwrite_replaces_block_and_duplicates_keep_last(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    k = key(1)
    assert run(tier.put([k], [random_block(0, 1)])) == [True]
    assert run(tier.put([k, k], [random_block(0, 2), random_block(0, 3)])) == [True, True]
    ok, out = get_one(tier, k)
    assert ok and torch.equal(out, random_block(0, 3))
    assert tier.usage_bytes() == LAYOUTS[0].nbytes
    assert len(files_under(tmp_path)) == 1
    run(tier.close())


def test_io_runs_in_parallel_on_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path, io_threads=4)
    barrier = threading.Barrier(4, timeout=10)
    threads: set[str] = set()
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset):
        threads.add(threading.current_thread().name)
        barrier.wait()  # only passes when four writes are in flight at once
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    keys = [key(i) for i in range(4)]
    assert run(tier.put(keys, [random_block(0, i) for i in range(4)])) == [True] * 4
    assert len(threads) == 4 and all(name.startswith("kvtier-file-disk") for name in threads)
    run(tier.close())


def test_batches_in_flight_together_share_the_threads_without_a_task_each_per_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight gets at once on four threads: the first takes the four threads, the ones that arrive while
    all are taken queue as one task each; every block still comes back exact (the Python read path:
    the native one, below, makes one task per eight blocks)."""
    monkeypatch.setattr(file_module, "usable_cpus", lambda: 4)  # reads may use all four threads
    tier = make_tier(tmp_path, io_threads=4)
    tier._native_reads = False
    keys = [key(i) for i in range(32)]
    blocks = [random_block(0, i) for i in range(32)]
    assert run(tier.put(keys, blocks)) == [True] * 32
    submitted = []
    real_submit = tier._executor.submit

    def submit(fn, *args, **kwargs):
        submitted.append(fn)
        return real_submit(fn, *args, **kwargs)

    tier._executor.submit = submit  # type: ignore[method-assign]
    out = [torch.zeros_like(b) for b in blocks]

    async def together() -> list[list[bool]]:
        return await asyncio.gather(*[tier.get(keys[i:i + 4], out[i:i + 4]) for i in range(0, 32, 4)])

    assert run(together()) == [[True] * 4] * 8
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert len(submitted) == 4 + 7
    assert run(tier.get(keys[:4], out[:4])) == [True] * 4  # alone again: the four threads
    assert len(submitted) == 4 + 7 + 4
    run(tier.close())


def test_reads_use_at_most_one_thread_per_cpu_and_writes_all_io_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On two CPUs, a tier of four I/O threads reads warm blocks on two threads (more would only pass
    the GIL back and forth) and writes on four (writes wait on the disk); a cold block hands the rest
    of the read to the four. Every block comes back exact."""
    monkeypatch.setattr(file_module, "usable_cpus", lambda: 2)
    tier = make_tier(tmp_path, io_threads=4)
    tier._native_reads = False  # the Python read path (the native one: test_native_reads_*)
    readers: set[str] = set()
    writers: set[str] = set()
    waiting = [4]  # the first four writes wait for each other
    four_at_once = threading.Barrier(4, timeout=10)
    lock = threading.Lock()
    real_read, real_write = tier._read_cached_block, tier._write_block

    def read(*args):
        readers.add(threading.current_thread().name)
        return real_read(*args)

    def write(*args):
        with lock:
            writers.add(threading.current_thread().name)
            first = waiting[0] > 0
            waiting[0] -= first
        if first:  # the first four writes wait for each other: they run on four threads at once
            with contextlib.suppress(threading.BrokenBarrierError):
                four_at_once.wait()
        return real_write(*args)

    monkeypatch.setattr(tier, "_read_cached_block", read)
    monkeypatch.setattr(tier, "_write_block", write)
    keys = [key(i) for i in range(64)]
    blocks = [random_block(0, i) for i in range(64)]
    assert run(tier.put(keys, blocks)) == [True] * 64
    assert len(writers) == 4 and not four_at_once.broken
    out = [torch.zeros_like(b) for b in blocks]

    async def together() -> list[list[bool]]:
        return await asyncio.gather(*[tier.get(keys[i:i + 8], out[i:i + 8]) for i in range(0, 64, 8)])

    assert run(together()) == [[True] * 8] * 8
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert 1 <= len(readers) <= 2 and not readers & writers
    if hasattr(os, "RWF_NOWAIT"):  # a cold block hands the rest of the read to the full pool
        full_pool_read = threading.Event()
        put_off: list[str] = []

        def cold_read(*args):
            name = threading.current_thread().name
            if "-read" not in name:
                full_pool_read.set()
            outcome = real_read(*args)
            if outcome is None and "-read" in name:
                put_off.append(name)
            return outcome

        monkeypatch.setattr(tier, "_read_cached_block", cold_read)
        drop_from_page_cache(tier, keys)
        out = [torch.zeros_like(b) for b in blocks]
        assert run(tier.get(keys, out)) == [True] * 64
        assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
        assert full_pool_read.is_set() or not put_off  # (none put off where the kernel read ahead in time)
    run(tier.close())


def test_a_long_batch_shared_by_the_threads_keeps_every_result_in_place(tmp_path: Path) -> None:
    """More blocks than threads, mixed with a damaged file, a deleted one and a key never stored: each
    result lands at its own index and every hit is exact, whichever thread read it."""
    tier = make_tier(tmp_path, io_threads=3)
    n = 40
    keys = [key(i) for i in range(n)]
    blocks = [random_block(0, i) for i in range(n)]
    assert run(tier.put(keys, blocks)) == [True] * n
    with open(tier.path_of(keys[7]), "r+b") as f:
        f.seek(PAGE + 100)
        f.write(b"\xff\x00\xff")
    tier.path_of(keys[23]).unlink()
    wanted = [*keys[:30], key(999), *keys[30:]]
    out = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in wanted]
    hits = run(tier.get(wanted, out))
    assert [i for i, hit in enumerate(hits) if not hit] == [7, 23, 30]
    assert all(torch.equal(out[i], blocks[i if i < 30 else i - 1]) for i in range(len(wanted)) if hits[i])
    assert tier.counters.errors == {"corrupt": 1, "missing": 1}
    run(tier.close())


@pytest.mark.parametrize("cold", [False, True])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, PAGE + LAYOUTS[0].nbytes - 1), flip=st.integers(1, 255))
def test_a_block_read_and_hashed_in_pieces_is_exact_or_a_miss(monkeypatch: pytest.MonkeyPatch, cold: bool,
                                                              position: int, flip: int) -> None:
    """With 16 KiB pieces a 64 KiB block is read and hashed in four (from the page cache, or from the
    disk after the cache dropped it): one damaged byte anywhere in the header or the payload is a
    miss, counted ``corrupt``; the header page's zero padding is not part of the block."""
    monkeypatch.setattr(file_module, "READ_CHUNK", 16 * 1024)
    with tempfile.TemporaryDirectory() as root:
        tier = make_tier(Path(root))
        keys = [key(i) for i in range(3)]
        blocks = [random_block(0, i) for i in range(3)]
        assert run(tier.put(keys, blocks)) == [True] * 3
        path = tier.path_of(keys[1])
        with open(path, "r+b") as f:
            f.seek(position)
            byte = f.read(1)[0]
            f.seek(position)
            f.write(bytes([byte ^ flip]))
        if cold:
            for k in keys:
                fd = os.open(tier.path_of(k), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        out = [torch.zeros_like(b) for b in blocks]
        hits = run(tier.get(keys, out))
        damaged = position < file_module.HEADER_SIZE or position >= PAGE
        assert hits == [True, not damaged, True]
        assert all(torch.equal(o, b) for o, b, hit in zip(out, blocks, hits, strict=True) if hit)
        assert tier.counters.errors == ({"corrupt": 1} if damaged else {})
        assert path.exists() != damaged
        run(tier.close())


async def cancel_once_started(call: Awaitable[object], started: threading.Event,
                              release: threading.Event) -> None:
    """Cancel ``call`` once its I/O has ``started``, then ``release`` the blocked I/O and expect the
    cancellation."""
    task = asyncio.ensure_future(call)
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_cancelled_get_takes_no_further_blocks_and_leaves_buffers_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling a get stops the I/O threads after the block each is reading; once the cancellation
    has returned, no thread writes into the caller's buffers."""
    tier = make_tier(tmp_path, io_threads=2)
    n = 30
    keys = [key(i) for i in range(n)]
    assert run(tier.put(keys, [random_block(0, i) for i in range(n)])) == [True] * n
    started = threading.Event()
    release = threading.Event()
    reads = []
    real_preadv = os.preadv

    def slow_preadv(fd, buffers, offset, *flags):
        reads.append(offset)
        started.set()
        release.wait(10)
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    out = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]

    run(cancel_once_started(tier.get(keys, out), started, release))
    read_then = len(reads)
    snapshot = [o.clone() for o in out]
    threading.Event().wait(0.2)
    assert read_then <= 2  # one block per thread was in flight; none was started after the cancel
    assert len(reads) == read_then and all(torch.equal(a, b) for a, b in zip(out, snapshot, strict=True))
    run(tier.close())


def drop_from_page_cache(tier: FileTier, keys: list[BlockKey]) -> None:
    for k in keys:
        fd = os.open(tier.path_of(k), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this platform")
@pytest.mark.parametrize("direct_io", [True, False])
def test_cold_blocks_are_put_off_and_read_after_the_cached_ones(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                direct_io: bool) -> None:
    """A read first tries the page cache alone; a block that is not there is read after the rest."""
    tier = make_tier(tmp_path, io_threads=1, direct_io=direct_io)
    keys = [key(i) for i in range(6)]
    blocks = [random_block(0, i) for i in range(6)]
    assert run(tier.put(keys, blocks)) == [True] * 6
    warm_up = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]
    assert run(tier.get(keys, warm_up)) == [True] * 6  # all in the page cache (O_DIRECT writes skip it)
    cold = keys[::2]
    drop_from_page_cache(tier, cold)
    real_preadv = os.preadv
    calls: list[tuple[str, bool]] = []

    def spy(fd: int, buffers: list, offset: int, *flags: int) -> int:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), bool(flags and flags[0] & os.RWF_NOWAIT)))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    out = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]
    assert run(tier.get(keys, out)) == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))
    assert all(nowait for _, nowait in calls[:6])  # one page-cache-only attempt per block, in order
    waited = [path for path, nowait in calls[6:] if not nowait]
    if waited:  # (a cold block the kernel read ahead in time is served by its first attempt)
        assert set(waited) <= {str(tier.path_of(k)) for k in cold}
    assert tier.counters.errors == {}
    run(tier.close())


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this platform")
def test_a_cancelled_get_reads_none_of_its_put_off_blocks(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while reading the cold blocks it put off: no further block is read, and once the
    cancellation has returned no thread writes into the caller's buffers."""
    tier = make_tier(tmp_path, io_threads=2)  # O_DIRECT writes: every block is cold on the first get
    n = 20
    keys = [key(i) for i in range(n)]
    assert run(tier.put(keys, [random_block(0, i) for i in range(n)])) == [True] * n
    drop_from_page_cache(tier, keys)
    started = threading.Event()
    release = threading.Event()
    waited: list[int] = []
    real_preadv = os.preadv

    def nowait_fails(fd: int, buffers: list, offset: int, *flags: int) -> int:
        if flags and flags[0] & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "not cached")  # every block is put off
        waited.append(fd)
        started.set()
        release.wait(10)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", nowait_fails)
    out = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]

    run(cancel_once_started(tier.get(keys, out), started, release))
    read_then = len(waited)
    snapshot = [o.clone() for o in out]
    threading.Event().wait(0.2)
    assert 1 <= read_then <= 2  # one put-off block per thread was being read; none started after
    assert len(waited) == read_then and all(torch.equal(a, b) for a, b in zip(out, snapshot, strict=True))
    monkeypatch.setattr(os, "preadv", real_preadv)
    again = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]
    assert run(tier.get(keys, again)) == [True] * n  # nothing was dropped by the cancelled call
    run(tier.close())


def test_a_filesystem_without_nowait_reads_gets_plain_reads(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path, io_threads=1)
    keys = [key(i) for i in range(4)]
    blocks = [random_block(0, i) for i in range(4)]
    assert run(tier.put(keys, blocks)) == [True] * 4
    real_preadv = os.preadv
    flagged = []

    def refusing(fd: int, buffers: list, offset: int, *flags: int) -> int:
        if flags and flags[0]:
            flagged.append(flags[0])
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    for _ in range(2):
        out = [torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8) for _ in keys]
        assert run(tier.get(keys, out)) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))
    assert len(flagged) <= 1  # refused once, then never asked again
    assert tier.counters.errors == {}
    run(tier.close())


def test_restart_keeps_blocks_and_rebuilds_index(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, compression="lz4")
    keys = [key(i, g) for g in LAYOUTS for i in range(4)]
    blocks = [kv_like_block(k.group_id, n) for n, k in enumerate(keys)]
    assert all(run(tier.put(keys, blocks)))
    run(tier.close())

    again = make_tier(tmp_path)  # a restart may change compression: files say what they hold
    assert set(again.keys()) == set(keys)
    assert again.usage_bytes() == tier.usage_bytes()
    out = [torch.empty_like(b) for b in blocks]
    assert run(again.get(keys, out)) == [True] * len(keys)
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
    run(again.close())


def test_start_removes_tmp_and_invalid_files_and_leaves_foreign_groups(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = make_tier(tmp_path)
    good, other = key(1), key(2)
    assert all(run(tier.put([good, other], [random_block(0, 1), random_block(0, 2)])))
    run(tier.close())
    shard = tier.path_of(good).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    (shard / f".{good.block_hash.hex()}.{dead_pid}.abcd.tmp").write_bytes(b"half a block")
    (tier.directory / f".probe.{dead_pid}.abcd.tmp").write_bytes(b"")
    live = shard / f".{other.block_hash.hex()}.{os.getppid()}.beef.tmp"  # another process's write in flight
    live.write_bytes(b"in flight")
    (shard / "not-hex.kvb").write_bytes(bytes(2 * PAGE))
    (shard / f"{'ab' * 16}.kvb").write_bytes(bytes(2 * PAGE))  # its shard should be "ab"
    tier.path_of(key(3)).write_bytes(bytes(3 * PAGE))  # right name, zero header
    wrong_key = tier.path_of(key(4))
    wrong_key.parent.mkdir(exist_ok=True)
    wrong_key.write_bytes(tier.path_of(other).read_bytes())  # a valid block filed under another name
    foreign = tier.directory / "g7" / "00"
    foreign.mkdir(parents=True)
    (foreign / "00.kvb").write_bytes(b"x")

    with caplog.at_level(logging.INFO, logger="kvtier.tiers.file"):
        again = make_tier(tmp_path)
    assert set(again.keys()) == {good, other}
    assert files_under(tier.directory / "g0") == {tier.path_of(good).name, tier.path_of(other).name,
                                                  live.name}
    assert list(tmp_path.rglob("*.tmp")) == [live]
    assert (foreign / "00.kvb").exists()
    assert "g7" in caplog.text and "4 invalid and 2 temporary files removed" in caplog.text
    run(again.close())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["payload", "header_hash", "magic", "truncate_payload", "truncate_header"])
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage: str, compression: str) -> None:
    tier = make_tier(tmp_path, compression=compression)
    k = key(5)
    assert run(tier.put([k], [kv_like_block(0, 5)])) == [True]
    path = tier.path_of(k)
    if damage == "payload":
        flip_byte(path, PAGE + 100)
    elif damage == "header_hash":
        flip_byte(path, 50)  # the stored block hash follows the 48 fixed header bytes
    elif damage == "magic":
        flip_byte(path, 0)
    elif damage == "truncate_payload":
        os.truncate(path, PAGE + 1000)
    else:
        os.truncate(path, 100)
    ok, _ = get_one(tier, k)
    assert not ok
    assert not path.exists()
    assert run(tier.contains([k])) == [False]
    assert tier.usage_bytes() == 0
    assert tier.counters.errors == {"corrupt": 1}
    run(tier.close())


def test_file_deleted_under_the_tier_is_a_miss(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    k = key(6)
    assert all(run(tier.put([k], [random_block(0, 6)])))
    tier.path_of(k).unlink()
    assert get_one(tier, k)[0] is False
    assert list(tier.keys()) == []
    assert tier.counters.errors == {"missing": 1}
    run(tier.delete([k]))  # absent keys are ignored
    run(tier.close())


def test_enospc_on_store_is_false_leaves_nothing_and_recovers(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path)
    old = key(7)
    assert all(run(tier.put([old], [random_block(0, 70)])))
    real_pwritev = os.pwritev

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    new = key(8)
    assert run(tier.put([old, new], [random_block(0, 71), random_block(0, 8)])) == [False, False]
    assert files_under(tmp_path) == set()  # no temp file, and the old version of `old` is gone too
    assert list(tier.keys()) == [] and tier.usage_bytes() == 0
    assert tier.counters.errors == {"enospc": 2}

    def broken(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", broken)
    assert run(tier.put([new], [random_block(0, 8)])) == [False]
    assert tier.counters.errors == {"enospc": 2, "io": 1}

    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert run(tier.put([new], [random_block(0, 8)])) == [True]
    ok, out = get_one(tier, new)
    assert ok and torch.equal(out, random_block(0, 8))
    run(tier.close())


def test_eio_on_read_is_a_miss_and_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path)
    k = key(9)
    assert all(run(tier.put([k], [random_block(0, 9)])))
    real_preadv = os.preadv

    def failing(fd, buffers, offset, *flags):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    assert get_one(tier, k)[0] is False
    assert tier.counters.errors == {"io": 1}
    assert tier.path_of(k).exists() and run(tier.contains([k])) == [True]
    monkeypatch.setattr(os, "preadv", real_preadv)
    ok, out = get_one(tier, k)
    assert ok and torch.equal(out, random_block(0, 9))
    run(tier.close())


def test_wrong_buffers_raise_layout_mismatch(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    k = key(10)
    with pytest.raises(LayoutMismatch):
        run(tier.put([k], [torch.empty(LAYOUTS[0].nbytes - 1, dtype=torch.uint8)]))
    with pytest.raises(LayoutMismatch):
        run(tier.get([k], [torch.empty(LAYOUTS[0].nbytes // 2, dtype=torch.float16)]))
    with pytest.raises(LayoutMismatch):
        run(tier.put([key(1, group=5)], [torch.empty(8, dtype=torch.uint8)]))
    with pytest.raises(LayoutMismatch):
        run(tier.put([k, key(11)], [random_block(0, 1)]))
    assert files_under(tmp_path) == set()
    run(tier.close())


def test_namespaces_do_not_see_each_other(tmp_path: Path) -> None:
    a, b = make_tier(tmp_path, "model-a"), make_tier(tmp_path, "model-b")
    k = key(12)
    assert all(run(a.put([k], [random_block(0, 1)])))
    assert all(run(b.put([key(13)], [random_block(0, 2)])))
    assert run(b.contains([k])) == [False] and get_one(b, k)[0] is False
    assert set(a.keys()) == {k} and set(b.keys()) == {key(13)}
    assert set(make_tier(tmp_path, "model-b").keys()) == {key(13)}
    run(a.close())
    run(b.close())


def test_permissions_are_private(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    k = key(14)
    assert all(run(tier.put([k], [random_block(0, 14)])))
    path = tier.path_of(k)
    for directory in (tier.directory, path.parent.parent, path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    run(tier.close())


@pytest.mark.parametrize("refused_by", ["open", "pwritev"])
def test_o_direct_einval_falls_back_to_buffered_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture, refused_by: str) -> None:
    real_open, real_pwritev = os.open, os.pwritev

    def open_no_direct(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def pwritev_no_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)

    if refused_by == "open":
        monkeypatch.setattr(os, "open", open_no_direct)
    else:
        monkeypatch.setattr(os, "pwritev", pwritev_no_direct)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        tier = make_tier(tmp_path, write_io="direct", direct_reads=True)
        keys = [key(i, 1) for i in range(3)]
        blocks = [random_block(1, i) for i in range(3)]
        assert run(tier.put(keys, blocks)) == [True] * 3
    assert not tier.direct_io_active
    assert tier.write_io_active == "synced"  # the fallback keeps durability on return
    assert caplog.text.count("O_DIRECT is not supported") == 1
    out = [torch.empty_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(blocks, out, strict=True))
    run(tier.close())


def test_direct_io_can_be_switched_off(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, direct_io=False)
    assert not tier.direct_io_active
    assert all(run(tier.put([key(1, 1)], [random_block(1, 1)])))
    assert tier.path_of(key(1, 1)).stat().st_size == 2 * PAGE
    assert get_one(tier, key(1, 1))[0]
    run(tier.close())


def test_over_capacity_is_stored_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = FileTier("disk", LAYOUTS, {0: LAYOUTS[0].nbytes}, root=tmp_path, namespace="ns")
    with caplog.at_level(logging.DEBUG, logger="kvtier.tiers.file"):
        assert run(tier.put([key(1), key(2)], [random_block(0, 1), random_block(0, 2)])) == [True, True]
    assert tier.usage_bytes() == 2 * LAYOUTS[0].nbytes
    assert "over its capacity" in caplog.text
    run(tier.delete([key(1), key(1), key(2)]))
    assert tier.usage_bytes() == 0 and files_under(tmp_path) == set()
    run(tier.close())


OPS = st.lists(st.tuples(st.sampled_from(["put", "put_fail", "delete", "restart"]),
                         st.lists(st.integers(0, 5), min_size=1, max_size=4)), max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_index_always_matches_files_on_disk(ops: list[tuple[str, list[int]]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwritev = os.pwritev
    fail = {"on": False}

    def pwritev(fd, buffers, offset):
        if fail["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with tempfile.TemporaryDirectory() as root:
        tier = make_tier(Path(root), io_threads=2)
        model: dict[BlockKey, int] = {}
        for step, (op, ids) in enumerate(ops):
            keys = [key(i, i % 2) for i in ids]
            if op in ("put", "put_fail"):
                fail["on"] = op == "put_fail"
                seeds = [step * 10 + n for n in range(len(keys))]
                blocks = [random_block(k.group_id, s) for k, s in zip(keys, seeds, strict=True)]
                ok = run(tier.put(keys, blocks))
                fail["on"] = False
                assert all(ok) == (op == "put")
                for k, s in zip(keys, seeds, strict=True):
                    if op == "put":
                        model[k] = s
                    else:
                        model.pop(k, None)
            elif op == "delete":
                run(tier.delete(keys))
                for k in keys:
                    model.pop(k, None)
            else:
                run(tier.close())
                tier = make_tier(Path(root), io_threads=2)
            assert set(tier.keys()) == keys_on_disk(tier) == set(model)
            assert tier.usage_bytes() == sum(LAYOUTS[k.group_id].nbytes for k in model)
            assert not list(Path(root).rglob("*.tmp"))
        for k, seed in model.items():
            ok, out = get_one(tier, k)
            assert ok and torch.equal(out, random_block(k.group_id, seed))
        run(tier.close())


# --- write_io -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "mode"), [({}, "synced"), ({"direct_io": True}, "direct"),
                                              ({"direct_io": False}, "buffered"),
                                              ({"write_io": "buffered"}, "buffered"),
                                              ({"write_io": "synced", "direct_io": False}, "synced"),
                                              ({"write_io": "direct", "direct_io": True}, "direct")])
def test_write_io_and_the_older_direct_io_key_choose_the_write_mode(tmp_path: Path, kwargs, mode) -> None:
    tier = make_tier(tmp_path, **kwargs)
    assert (tier.write_io, tier.write_io_active, tier.direct_io_active) == (mode, mode, mode == "direct")
    blocks = [random_block(0, 1), random_block(1, 2)]
    assert run(tier.put([key(1), key(2, 1)], blocks)) == [True, True]
    run(tier.close())
    again = make_tier(tmp_path, **kwargs)  # what a put acknowledged is found by a restarted tier
    for k, block in zip((key(1), key(2, 1)), blocks, strict=True):
        ok, out = get_one(again, k)
        assert ok and torch.equal(out, block)
    run(again.close())


@pytest.mark.parametrize("kwargs", [{"write_io": "synced", "direct_io": True},
                                    {"write_io": "buffered", "direct_io": True},
                                    {"write_io": "direct", "direct_io": False},
                                    {"write_io": "fast"}])
def test_a_bad_or_contradicting_write_io_is_refused(tmp_path: Path, kwargs) -> None:
    with pytest.raises(KVTierConfigError) as info:
        make_tier(tmp_path, **kwargs)
    assert info.value.path == "write_io"
    assert str(kwargs["write_io"]) in str(info.value)


def test_synced_writes_start_every_write_back_of_a_threads_share_before_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One I/O thread, a batch of 5: five buffered writes each start their write-back, then the thread
    waits for each (sync_file_range WAIT_BEFORE|WRITE|WAIT_AFTER) and only then renames it into place;
    every block is then readable from the page cache alone (RWF_NOWAIT)."""
    real = file_module._SYNC_FILE_RANGE
    if real is None:
        pytest.skip("sync_file_range is not available here")
    calls: list[tuple[str, int]] = []
    renamed: list[str] = []
    real_rename = os.rename

    def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(("wait" if flags & 4 else "start", len(renamed)))
        return real(fd, offset, nbytes, flags)

    def spy_rename(src, dst):
        renamed.append(str(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(file_module, "_SYNC_FILE_RANGE", spy)
    monkeypatch.setattr(os, "rename", spy_rename)
    tier = make_tier(tmp_path, write_io="synced", io_threads=1)
    keys = [key(i) for i in range(5)]
    blocks = [random_block(0, i) for i in range(5)]
    assert run(tier.put(keys, blocks)) == [True] * 5
    assert [c[0] for c in calls] == ["start"] * 5 + ["wait"] * 5
    assert [c[1] for c in calls[5:]] == [0, 1, 2, 3, 4]  # each wait before its rename, renames in order
    assert files_under(tier.directory) == {tier.path_of(k).name for k in keys}
    if hasattr(os, "RWF_NOWAIT"):
        for k, block in zip(keys, blocks, strict=True):
            fd = os.open(tier.path_of(k), os.O_RDONLY)
            try:
                cached = bytearray(LAYOUTS[0].nbytes)
                assert os.preadv(fd, [cached], PAGE, os.RWF_NOWAIT) == len(cached)
            finally:
                os.close(fd)
            assert bytes(cached) == block.numpy().tobytes()
    run(tier.close())


def test_a_failed_write_back_wait_is_a_false_put_that_leaves_no_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error reported while waiting for the write-back (EIO, or ENOSPC from delayed
    allocation) fails that block only: no temporary file, and its older version is deleted."""
    tier = make_tier(tmp_path, write_io="synced", io_threads=2)
    assert run(tier.put([key(1)], [random_block(0, 1)])) == [True]
    real_wait = file_module._wait_writeback
    doomed = f".{key(1).block_hash.hex()}."  # the temporary file of key(1)'s new version

    def failing_wait(fd: int) -> None:
        if doomed in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_wait(fd)

    monkeypatch.setattr(file_module, "_wait_writeback", failing_wait)
    assert run(tier.put([key(1), key(2)], [random_block(0, 10), random_block(0, 2)])) == [False, True]
    assert files_under(tier.directory) == {tier.path_of(key(2)).name}
    assert run(tier.contains([key(1), key(2)])) == [False, True]
    assert tier.counters.errors.get("enospc") == 1
    run(tier.close())


def test_a_cancelled_synced_put_finishes_the_writes_it_started(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A put cancelled while its threads wait for write-backs still ends every started write: each
    file is renamed into place and indexed, or removed, and no temporary file is left."""
    tier = make_tier(tmp_path, write_io="synced", io_threads=2)
    waiting = threading.Event()
    release = threading.Event()
    real_wait = file_module._wait_writeback

    def slow_wait(fd: int) -> None:
        waiting.set()
        release.wait(10)
        real_wait(fd)

    monkeypatch.setattr(file_module, "_wait_writeback", slow_wait)
    n = 12
    keys = [key(i) for i in range(n)]

    run(cancel_once_started(tier.put(keys, [random_block(0, i) for i in range(n)]), waiting, release))
    on_disk = files_under(tier.directory)
    assert not any(name.endswith(".tmp") for name in on_disk)
    assert on_disk == {tier.path_of(k).name for k in tier.keys()}
    assert len(on_disk) == n  # every write had started before the threads began to wait
    for i, k in enumerate(keys):
        ok, out = get_one(tier, k)
        assert ok and torch.equal(out, random_block(0, i))
    run(tier.close())


@pytest.mark.parametrize("write_io", ["synced", "buffered", "direct"])
def test_direct_reads_use_o_direct_in_every_write_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       write_io: str) -> None:
    tier = make_tier(tmp_path, write_io=write_io, direct_reads=True)
    keys = [key(1), key(2, 1)]
    blocks = [random_block(0, 1), random_block(1, 2)]
    assert run(tier.put(keys, blocks)) == [True, True]
    opened: list[int] = []
    real_open = os.open

    def spy_open(path, flags, *args, **kwargs):
        if str(path).endswith(".kvb"):
            opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy_open)
    for k, block in zip(keys, blocks, strict=True):
        ok, out = get_one(tier, k)
        assert ok and torch.equal(out, block)
    assert len(opened) == 2 and all(flags & os.O_DIRECT for flags in opened)
    run(tier.close())


# --- the warm raw read's inline path (_read_cached_block) ------------------------------------------------
@pytest.mark.parametrize("damage", ["none", "payload", "header", "checksum", "truncate", "empty", "gone"])
def test_warm_raw_reads_are_exact_and_damage_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        damage: str) -> None:
    """A cached raw block is read by the inline path (no _read_block call) and is bit-exact; a flipped
    byte anywhere, a short or empty file or a missing one is a miss (the others' blocks unharmed)."""
    tier = make_tier(tmp_path)
    if not tier._nowait:
        pytest.skip("no RWF_NOWAIT reads here")
    groups = [0, 0, 1, 2]
    keys = [key(i, g) for i, g in enumerate(groups)]
    blocks = [random_block(g, i) for i, g in enumerate(groups)]
    assert run(tier.put(keys, blocks)) == [True] * 4
    path = tier.path_of(keys[1])
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[PAGE + 1234] ^= 0x40
    elif damage == "header":
        data[40] ^= 0x01
    elif damage == "checksum":
        data[_CHECKSUM_OFFSET] ^= 0x01
    elif damage == "truncate":
        data = data[:PAGE + 1000]
    elif damage == "empty":
        data = bytearray()
    if damage == "gone":
        path.unlink()
    elif damage != "none":
        path.write_bytes(bytes(data))
    slow: list[BlockKey] = []
    full_read = FileTier._read_block

    def spy(self: FileTier, k: BlockKey, *args: object, **kwargs: object):
        slow.append(k)
        return full_read(self, k, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FileTier, "_read_block", spy)
    out = [torch.zeros_like(b) for b in blocks]
    hits = run(tier.get(keys, out))
    assert hits == [True, damage == "none", True, True]
    for hit, got, want in zip(hits, out, blocks, strict=True):
        if hit:
            assert torch.equal(got, want)
    assert set(slow) <= {keys[1]}  # every intact block took the inline path
    if damage == "none":
        assert not slow and tier.counters.blocks_read == 4
    else:
        assert not path.exists() and keys[1] not in set(tier.keys())
        assert tier.counters.blocks_read == 3
        assert sum(tier.counters.errors.values()) == 1
    run(tier.close())


def test_get_refuses_wrong_out_buffers_by_name(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    keys = [key(0), key(1)]
    good = torch.zeros(LAYOUTS[0].nbytes, dtype=torch.uint8)
    for bad in (torch.zeros(LAYOUTS[0].nbytes + 1, dtype=torch.uint8),
                torch.zeros(LAYOUTS[0].nbytes // 2, dtype=torch.int16),
                torch.zeros(2 * LAYOUTS[0].nbytes, dtype=torch.uint8)[::2]):
        with pytest.raises(LayoutMismatch, match=r"out\[1\]"):
            run(tier.get(keys, [good, bad]))
    with pytest.raises(LayoutMismatch):
        run(tier.get(keys, [good]))
    with pytest.raises(LayoutMismatch):
        run(tier.get([key(0, group=7)], [good]))
    run(tier.close())


# --- 256 KiB and 2 MiB blocks in batches shared by the I/O threads ------------------------------------
BIG = {0: BlockLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16),  # 256 KiB
       1: BlockLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)}  # 2 MiB


def stored_big_batch(root: Path, group: int, n: int) -> tuple[FileTier, list[BlockKey], list[torch.Tensor]]:
    """A file tier on four I/O threads holding ``n`` random blocks of ``BIG[group]``, and those blocks."""
    tier = FileTier("disk", BIG, {g: 1 << 30 for g in BIG}, root=root, namespace="ns", io_threads=4)
    keys = [key(i, group) for i in range(n)]
    gen = torch.Generator().manual_seed(group)
    blocks = [torch.randint(0, 256, (BIG[group].nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]
    assert run(tier.put(keys, blocks)) == [True] * n
    return tier, keys, blocks


@pytest.mark.parametrize("group", [0, 1], ids=["256KiB", "2MiB"])
@pytest.mark.parametrize("damage", ["none", "payload", "header", "checksum", "truncate", "gone"])
def test_a_batch_of_real_sized_blocks_is_exact_and_damage_is_a_miss(
        tmp_path: Path, group: int, damage: str) -> None:
    """Eight warm blocks of 256 KiB or 2 MiB read by four threads: every intact block is bit-exact; a
    damaged block early and one late in the batch are misses, their files and index entries removed."""
    n = 8
    tier, keys, blocks = stored_big_batch(tmp_path, group, n)
    damaged = [1, 6] if damage != "none" else []
    for i in damaged:
        path = tier.path_of(keys[i])
        if damage == "gone":
            path.unlink()
            continue
        data = bytearray(path.read_bytes())
        if damage == "payload":
            data[PAGE + BIG[group].nbytes - 7] ^= 0x10
        elif damage == "header":
            data[40] ^= 0x01
        elif damage == "checksum":
            data[_CHECKSUM_OFFSET + 3] ^= 0x80
        elif damage == "truncate":
            data = data[:PAGE + BIG[group].nbytes // 2]
        path.write_bytes(bytes(data))
    out = [torch.zeros(BIG[group].nbytes, dtype=torch.uint8) for _ in keys]
    hits = run(tier.get(keys, out))
    assert hits == [i not in damaged for i in range(n)]
    assert all(torch.equal(out[i], blocks[i]) for i in range(n) if hits[i])
    assert set(tier.keys()) == {keys[i] for i in range(n) if i not in damaged}
    assert not any(tier.path_of(keys[i]).exists() for i in damaged)
    assert tier.counters.blocks_read == n - len(damaged)
    assert sum(tier.counters.errors.values()) == len(damaged)
    again = [torch.zeros(BIG[group].nbytes, dtype=torch.uint8) for _ in keys]
    assert run(tier.get(keys, again)) == hits  # the misses stay misses, without I/O
    run(tier.close())


@pytest.mark.parametrize("group", [0, 1], ids=["256KiB", "2MiB"])
@pytest.mark.parametrize("bad_at", [0, 7])
def test_a_wrong_out_buffer_in_a_real_sized_batch_reads_nothing_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int, bad_at: int) -> None:
    """A wrong buffer early or late in a batch is :class:`LayoutMismatch` naming it, raised before any
    block is read; every file and index entry stays, and the batch with the right buffer is exact."""
    n = 8
    tier, keys, blocks = stored_big_batch(tmp_path, group, n)
    reads = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset, *flags):
        reads.append(offset)
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    out = [torch.zeros(BIG[group].nbytes, dtype=torch.uint8) for _ in keys]
    out[bad_at] = torch.zeros(BIG[group].nbytes + PAGE, dtype=torch.uint8)
    with pytest.raises(LayoutMismatch, match=rf"out\[{bad_at}\]"):
        run(tier.get(keys, out))
    assert reads == [] and all(not o.any() for o in out)
    assert set(tier.keys()) == set(keys) and all(tier.path_of(k).exists() for k in keys)
    assert tier.counters.blocks_read == 0 and tier.counters.errors == {}
    assert not any(tier._tasks_in_flight.values())
    out[bad_at] = torch.zeros(BIG[group].nbytes, dtype=torch.uint8)
    assert run(tier.get(keys, out)) == [True] * n
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    run(tier.close())


def test_many_gets_in_flight_on_two_threads_all_finish_exact(tmp_path: Path) -> None:
    """Sixteen gets in flight on two threads (most queue as one task each): none waits on another
    forever and every block lands exact in its own buffer."""
    tier = make_tier(tmp_path, io_threads=2)
    n = 64
    keys = [key(i) for i in range(n)]
    blocks = [random_block(0, i) for i in range(n)]
    assert run(tier.put(keys, blocks)) == [True] * n
    out = [torch.zeros_like(b) for b in blocks]

    async def together() -> list[list[bool]]:
        gets = asyncio.gather(*[tier.get(keys[i:i + 4], out[i:i + 4]) for i in range(0, n, 4)])
        return await asyncio.wait_for(gets, 60)  # a hang guard, not a timing check

    assert run(together()) == [[True] * 4] * (n // 4)
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert not any(tier._tasks_in_flight.values()) and tier.counters.blocks_read == n
    run(tier.close())


@pytest.mark.parametrize("native", [True, False])
def test_get_into_one_row_batch(tmp_path: Path, native: bool) -> None:
    """``out`` as one ``[n, nbytes]`` tensor (what the cache passes for a run of its caller's rows):
    hits land in their rows, a key never stored is a miss that leaves its row alone; a batch of the
    wrong width, dtype or group is refused as a list of rows would be."""
    tier = make_tier(tmp_path)
    tier._native_reads = tier._native_reads and native
    keys = [key(i) for i in range(6)]
    blocks = torch.stack([random_block(0, i) for i in range(6)])
    assert run(tier.put(keys[:5], list(blocks[:5]))) == [True] * 5
    out = torch.full_like(blocks, 7)
    assert run(tier.get(keys, out)) == [True] * 5 + [False]
    assert torch.equal(out[:5], blocks[:5]) and bool((out[5] == 7).all())
    with pytest.raises(LayoutMismatch):
        run(tier.get(keys, torch.zeros(6, LAYOUTS[0].nbytes - 1, dtype=torch.uint8)))
    with pytest.raises(LayoutMismatch):
        run(tier.get(keys, torch.zeros(6, LAYOUTS[0].nbytes // 2, dtype=torch.int16)))
    with pytest.raises(LayoutMismatch):
        run(tier.get([key(0, group=1), *keys[1:]], torch.zeros_like(blocks)))
    run(tier.close())
