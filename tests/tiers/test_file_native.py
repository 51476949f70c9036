"""The file tier's native warm reads (kvtier/kernels/fileread.c): exact blocks, damage left to the
Python path (same outcomes, block for block), cold blocks asked for and read, the read pool only, and
no write into a caller's buffer after a cancelled get. Each test runs twice: on the native reader
threads (kvtier/kernels/reader_pool.py) and, as where they cannot serve, on the read pool."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.kernels import host
from kvtier.kernels.reader_pool import ReaderPool
from kvtier.tiers import file as file_module
from tests.tiers.test_file import (
    LAYOUTS,
    cancel_once_started,
    drop_from_page_cache,
    key,
    make_tier,
    random_block,
    run,
)

pytestmark = pytest.mark.skipif(not host.reads_available(), reason="the native reader cannot be built here")


@pytest.fixture(autouse=True, params=["native threads", "read pool"])
def reader_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which threads run the native reads: the tier's :class:`ReaderPool`, or (none made) its read pool."""
    if request.param == "read pool":
        monkeypatch.setattr(file_module, "ReaderPool", lambda threads: None)
    return str(request.param)


class Spy:
    """Wraps host.read_warm and ReaderPool.submit: the threads the reads ran on ("native" for the
    reader pool's) and every status returned. ``before``: a read's result waits for it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: threading.Event | None = None) -> None:
        self.threads: set[str] = set()
        self.statuses: list[int] = []
        self.started = threading.Event()
        real = host.read_warm
        real_submit = ReaderPool.submit

        def read_warm(*args, **kwargs):
            self.threads.add(threading.current_thread().name)
            self.started.set()
            if before is not None:
                before.wait(10)
            status = real(*args, **kwargs)
            self.statuses.extend(status.tolist())
            return status

        def submit(pool, *args, **kwargs):
            future = real_submit(pool, *args, **kwargs)
            if future is None:
                return None
            self.threads.add("native")
            self.started.set()
            if before is not None:  # hand the result on only once ``before`` is set
                loop, real_future = asyncio.get_running_loop(), future
                later = loop.create_future()

                def wait_then_chain() -> None:
                    before.wait(10)
                    loop.call_soon_threadsafe(real_future.add_done_callback,
                                              lambda done: later.set_result(done.result()))

                threading.Thread(target=wait_then_chain, daemon=True).start()
                future = later
            future.add_done_callback(lambda done: self.statuses.extend(done.result().tolist()))
            return future

        monkeypatch.setattr(host, "read_warm", read_warm)
        monkeypatch.setattr(ReaderPool, "submit", submit)


def test_a_warm_batch_of_mixed_groups_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of three block sizes in one batch: the first size is read natively, the others the
    Python way; every block bit-exact."""
    spy = Spy(monkeypatch)
    tier = make_tier(tmp_path)
    assert tier._native_reads
    keys = [key(i, group=i % 3) for i in range(24)]
    blocks = [random_block(k.group_id, i) for i, k in enumerate(keys)]
    assert run(tier.put(keys, blocks)) == [True] * 24
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 24
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert spy.statuses == [0] * 8  # the eight of group 0, in one call (24 blocks: one part)
    assert tier.counters.blocks_read == 24 and not tier.counters.errors
    run(tier.close())


def _damage(root: Path, tier: file_module.FileTier, keys: list) -> None:
    paths = [tier.path_of(k) for k in keys]
    data = bytearray(paths[1].read_bytes())
    data[PAGE_ + 100] ^= 0x10  # one bit of the payload
    paths[1].write_bytes(bytes(data))
    os.truncate(paths[2], PAGE_ + 10)  # short
    paths[3].unlink()
    paths[3].symlink_to(paths[0])  # a link to a good block
    paths[4].unlink()
    os.mkfifo(paths[4])  # opening must not wait for a writer
    paths[5].unlink()  # gone
    shutil.copyfile(paths[7], paths[6])  # another key's block: its header names the other key


PAGE_ = file_module.PAGE


@pytest.mark.parametrize("shape", ["one tensor per block", "rows of one tensor"])
def test_damaged_blocks_get_the_outcomes_the_python_path_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """A flipped bit, a short file, a symbolic link, a FIFO, a deleted file and a forged header: the
    native reader verifies only the good blocks; the rest get, block for block, the hits, counters and
    files the Python path gives them (whether ``out`` is a tensor per block or the ``[n, nbytes]`` rows
    the cache passes, which the native threads take as one batch)."""
    results = {}
    for native in (True, False):
        spy = Spy(monkeypatch)
        root = tmp_path / ("native" if native else "python")
        tier = make_tier(root)
        tier._native_reads = native
        keys = [key(i) for i in range(8)]
        blocks = [random_block(0, i) for i in range(8)]
        assert run(tier.put(keys, blocks)) == [True] * 8
        _damage(root, tier, keys)
        rows = torch.zeros(8, blocks[0].numel(), dtype=torch.uint8)
        out = list(rows) if shape == "rows of one tensor" else [torch.zeros_like(b) for b in blocks]
        hits = run(tier.get(keys, rows if shape == "rows of one tensor" else out))
        assert all(torch.equal(o, b) for o, b, hit in zip(out, blocks, hits, strict=True) if hit)
        left = sorted(p.name for p in root.rglob("*.kvb") if p.is_file() or p.is_symlink() or p.is_fifo())
        results[native] = (hits, dict(tier.counters.errors), left, run(tier.contains(keys)))
        assert spy.statuses == ([0, 2, 2, 2, 2, 2, 2, 0] if native else [])
        run(tier.close())
    assert results[True] == results[False]
    assert results[True][0] == [True, False, False, False, False, False, False, True]


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="no RWF_NOWAIT on this platform")
def test_cold_blocks_are_asked_for_and_read_the_python_way(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    tier = make_tier(tmp_path)
    keys = [key(i) for i in range(16)]
    blocks = [random_block(0, i) for i in range(16)]
    assert run(tier.put(keys, blocks)) == [True] * 16
    drop_from_page_cache(tier, keys[::2])
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 16
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    if spy.statuses.count(1) == 0:
        pytest.skip("the page cache kept the blocks (this filesystem ignores POSIX_FADV_DONTNEED)")
    assert spy.statuses.count(0) >= 8 and set(spy.statuses) <= {0, 1}
    run(tier.close())


def test_native_reads_run_on_the_read_pool_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_module, "usable_cpus", lambda: 2)
    spy = Spy(monkeypatch)
    tier = make_tier(tmp_path, io_threads=4)
    keys = [key(i) for i in range(64)]
    blocks = [random_block(0, i) for i in range(64)]
    assert run(tier.put(keys, blocks)) == [True] * 64
    out = [torch.zeros_like(b) for b in blocks]

    async def together() -> list[list[bool]]:
        return await asyncio.gather(*[tier.get(keys[i:i + 16], out[i:i + 16]) for i in range(0, 64, 16)])

    assert run(together()) == [[True] * 16] * 4
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert spy.threads == {"native"} or (1 <= len(spy.threads) <= 2
                                         and all("-read" in name for name in spy.threads))
    assert spy.statuses == [0] * 64
    run(tier.close())


@pytest.mark.parametrize("shape", ["one tensor per block", "rows of one tensor"])
def test_a_cancelled_native_get_leaves_the_buffers_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         shape: str) -> None:
    """The get is cancelled while a native call is about to run: the cancellation returns only once
    that call has finished, and nothing writes into the caller's buffers after it."""
    release = threading.Event()
    spy = Spy(monkeypatch, before=release)
    tier = make_tier(tmp_path, io_threads=2)
    keys = [key(i) for i in range(30)]
    assert run(tier.put(keys, [random_block(0, i) for i in range(30)])) == [True] * 30
    rows = torch.zeros(len(keys), LAYOUTS[0].nbytes, dtype=torch.uint8)
    out = list(rows)
    run(cancel_once_started(tier.get(keys, rows if shape == "rows of one tensor" else out), spy.started,
                            release))
    assert spy.statuses  # the call ran to its end before the cancellation came back
    snapshot = [o.clone() for o in out]
    threading.Event().wait(0.2)
    assert all(torch.equal(a, b) for a, b in zip(out, snapshot, strict=True))
    run(tier.close())


def test_a_wrapped_syscall_or_a_missing_helper_sends_reads_the_python_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper around ``os.preadv`` (a fault injector) must see the reads; without the helper
    (``read_warm`` answers None) the tier stops asking it. Blocks exact either way."""
    spy = Spy(monkeypatch)
    tier = make_tier(tmp_path)
    keys = [key(i) for i in range(8)]
    blocks = [random_block(0, i) for i in range(8)]
    assert run(tier.put(keys, blocks)) == [True] * 8
    seen = []
    real_preadv = os.preadv

    def traced(*args):
        seen.append(args[2])
        return real_preadv(*args)

    monkeypatch.setattr(os, "preadv", traced)
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 8 and len(seen) == 8 and spy.statuses == []
    monkeypatch.setattr(os, "preadv", real_preadv)
    monkeypatch.setattr(host, "read_warm", lambda *args, **kwargs: None)
    monkeypatch.setattr(ReaderPool, "submit", lambda *args, **kwargs: None)
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 8 and not tier._native_reads
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    run(tier.close())


def test_read_warm_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="32 hash bytes of 16 each"):  # two hashes, one address
        host.read_warm(b"/x/", bytes(32), 16, b".kvb", np.zeros(1, np.uint64), 16, 16, bytes(256), 128, 104,
                       4096)
    pool = ReaderPool(1)

    async def submit() -> None:
        with pytest.raises(ValueError, match="255 header bytes of 128 each"):
            pool.submit(b"/x/", bytes(32), 16, b".kvb", np.zeros(2, np.uint64), 16, 16, bytes(255), 128, 104,
                        4096)

    run(submit())
    pool.close()


def test_blocks_larger_than_a_read_chunk_are_read_a_chunk_at_a_time(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """2.5 read chunks per block: every piece lands and is hashed; a flipped bit in the last, short
    piece fails the checksum and the block goes the long way (a miss, the file dropped)."""
    from kvtier.layout import BlockLayout
    from kvtier.tiers.file import READ_CHUNK, FileTier

    layout = BlockLayout(num_layers=5, num_kv_heads=8, head_dim=128, block_size=64)
    assert layout.nbytes == 2 * READ_CHUNK + READ_CHUNK // 2
    spy = Spy(monkeypatch)
    tier = FileTier("big", {0: layout}, {0: 1 << 30}, root=tmp_path, namespace="ns")
    keys = [key(i) for i in range(4)]
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]
    assert run(tier.put(keys, blocks)) == [True] * 4
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 4
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True)) and spy.statuses == [0] * 4
    path = tier.path_of(keys[2])
    data = bytearray(path.read_bytes())
    data[PAGE_ + layout.nbytes - 1] ^= 1
    path.write_bytes(bytes(data))
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True, True, False, True]
    assert spy.statuses[4:] == [0, 0, 2, 0] and tier.counters.errors == {"corrupt": 1} and not path.exists()
    run(tier.close())


def test_a_second_live_event_loop_reads_on_the_read_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          reader_threads: str) -> None:
    """The reader threads report to one event loop: while it lives, a get from another loop is served
    by the read pool (exact all the same); once it is closed, the next loop takes the readers over."""
    spy = Spy(monkeypatch)
    tier = make_tier(tmp_path)
    keys = [key(i) for i in range(8)]
    blocks = [random_block(0, i) for i in range(8)]
    assert run(tier.put(keys, blocks)) == [True] * 8
    first = asyncio.new_event_loop()
    thread = threading.Thread(target=first.run_forever, daemon=True)
    thread.start()
    try:
        out = [torch.zeros_like(b) for b in blocks]
        assert asyncio.run_coroutine_threadsafe(tier.get(keys, out), first).result(10) == [True] * 8
        native = spy.threads == {"native"}
        assert native == (reader_threads == "native threads")
        spy.threads.clear()
        out = [torch.zeros_like(b) for b in blocks]
        assert run(tier.get(keys, out)) == [True] * 8  # another loop, while the first lives
        assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
        assert spy.threads and "native" not in spy.threads
    finally:
        first.call_soon_threadsafe(first.stop)
        thread.join(10)
        first.close()
    spy.threads.clear()
    out = [torch.zeros_like(b) for b in blocks]
    assert run(tier.get(keys, out)) == [True] * 8  # the first loop is closed: this one takes over
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert (spy.threads == {"native"}) == native
    run(tier.close())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_reads_with_reader_threads_of_its_own(tmp_path: Path, reader_threads: str) -> None:
    """The parent's reader threads do not survive a fork: the pool starts threads of its own in the
    child, which reads exact blocks; the parent's keep working. (The pool alone; the whole tier in a
    forked child: test_a_forked_child_uses_the_tier_it_inherited.)"""
    if reader_threads != "native threads":
        pytest.skip("the reader pool's own test")
    tier = make_tier(tmp_path)
    keys = [key(i) for i in range(8)]
    blocks = [random_block(0, i) for i in range(8)]
    assert run(tier.put(keys, blocks)) == [True] * 8
    out = torch.stack([torch.zeros_like(b) for b in blocks])  # (made here: torch can hang in a forked child)
    reads = [(k, tier._index[k], out[i].numpy()) for i, k in enumerate(keys)]
    job = tier._warm_job(reads, [out.data_ptr() + i * out.shape[1] for i in range(8)])
    assert job is not None and tier._readers is not None
    pool = tier._readers

    async def read() -> list[int]:
        future = pool.submit(job.prefix, job.hashes, job.hash_len, b".kvb", job.outs, job.size,
                             file_module.READ_CHUNK, job.expected, file_module.HEADER_SIZE,
                             file_module.CHECKSUM_OFFSET, file_module.PAGE)
        assert future is not None
        return (await future).tolist()

    assert run(read()) == [0] * 8
    expected = b"".join(b.numpy().tobytes() for b in blocks)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, and never hang
        signal.alarm(20)
        try:
            out.numpy().fill(0)
            os._exit(0 if run(read()) == [0] * 8 and out.numpy().tobytes() == expected else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    out.zero_()
    assert run(read()) == [0] * 8 and out.numpy().tobytes() == expected
    run(tier.close())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_uses_the_tier_it_inherited(tmp_path: Path, reader_threads: str) -> None:
    """A tier used in the parent (its I/O threads running) works in a forked child as a fresh one over
    the same files: the child reads the parent's blocks and stores its own (before, the child's first
    get waited forever for the parent's threads); the parent reads the child's block afterwards."""
    tier = make_tier(tmp_path)
    keys = [key(i) for i in range(9)]
    blocks = [random_block(0, i) for i in range(9)]
    assert run(tier.put(keys[:8], blocks[:8])) == [True] * 8
    out = [torch.zeros_like(b) for b in blocks]  # (made here: torch can hang in a forked child)
    assert run(tier.get(keys[:8], out[:8])) == [True] * 8
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, and never hang
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (a Python handler would wait for a blocked thread)
        signal.alarm(20)
        try:
            for o in out:
                o.numpy().fill(0)
            ok = run(tier.get(keys[:8], out[:8])) == [True] * 8 and all(
                o.numpy().tobytes() == b.numpy().tobytes() for o, b in zip(out[:8], blocks[:8], strict=True))
            ok = ok and run(tier.put(keys[8:], blocks[8:])) == [True]
            run(tier.close())
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert run(tier.get(keys[:8], out[:8])) == [True] * 8
    run(tier.close())
    reopened = make_tier(tmp_path)  # the child's block too, from the same directory
    assert run(reopened.get(keys, out)) == [True] * 9
    assert all(torch.equal(o, b) for o, b in zip(out, blocks, strict=True))
    run(reopened.close())
