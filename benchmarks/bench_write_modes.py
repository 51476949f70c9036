"""How to write a block file so that it is on the disk when the write returns: the file tier's choice.

Not a test: it prints one table per block size. Each row writes the same blocks (one file per block,
``pwritev([header page, block])``, the file tier's layout) from ``--threads`` threads in batches of
``--batch``, then reads them back, in the modes the file tier could use:

- ``direct``: ``O_DIRECT`` writes (the file tier's default). On the device when ``pwritev`` returns;
  nothing enters the page cache, so the read back comes from the disk.
- ``buffered+fdatasync``: a buffered write, then ``fdatasync`` on the I/O thread.
- ``buffered+sync_file_range``: a buffered write, then ``sync_file_range(WAIT_BEFORE | WRITE |
  WAIT_AFTER)`` (the data only, like ``O_DIRECT``; no metadata flush) on the I/O thread.
- ``buffered+range batch``: a buffered write that starts the write-back at once
  (``sync_file_range(WRITE)``), and a wait for the written ranges (``sync_file_range(WAIT_BEFORE |
  WRITE | WAIT_AFTER)``) once the thread's share of the batch is written, so the disk has several
  files in flight per thread (the file tier's ``write_io: synced``).
- ``buffered+range, fdatasync batch``: the same, but the wait is an ``fdatasync`` per file (which
  also commits the file's size and flushes the device's write cache).
- ``buffered`` (no sync): what a write costs before the kernel writes it back; ``write+sync`` adds
  one ``sync()`` at the end, which is how the peer harness measures the page-cache writers.

The three synced buffered modes leave clean pages in the page cache, so their read back is warm.
Columns are MB/s (1e6 B/s), the median of ``--repeat`` interleaved rounds. Needs root for
``drop_caches`` (to start every round from the same state); without it the rounds run warm.

Usage: ``python benchmarks/bench_write_modes.py [--block-kib 256,2048] [--mib 512] [--dir DIR]
[--threads 4] [--batch 32] [--repeat 3]``. DIR must be on the disk under test (not tmpfs).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PAGE = 4096
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
MODES = ("direct", "buffered+fdatasync", "buffered+sync_file_range", "buffered+range batch",
         "buffered+range, fdatasync batch", "buffered")


def _sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    func = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None)
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return func


SYNC_FILE_RANGE = _sync_file_range()


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


class Run:
    def __init__(self, directory: Path, block: int, count: int, threads: int, batch: int) -> None:
        self.directory, self.block, self.count, self.batch = directory, block, count, batch
        self.header = memoryview(mmap.mmap(-1, PAGE))
        self.payload = memoryview(mmap.mmap(-1, block))
        self.payload[:] = os.urandom(block)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        self.local = threading.local()

    def path(self, mode: str, i: int) -> str:
        return f"{self.directory}/{MODES.index(mode)}-{i}.kvb"

    def _write(self, mode: str, jobs: list[int]) -> None:
        waiting: list[int] = []
        for i in jobs:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if mode == "direct" else 0)
            fd = os.open(self.path(mode, i), flags, 0o600)
            os.pwritev(fd, [self.header, self.payload], 0)
            if mode == "buffered+fdatasync":
                os.fdatasync(fd)
            elif mode == "buffered+sync_file_range":
                assert SYNC_FILE_RANGE is not None
                SYNC_FILE_RANGE(fd, 0, 0, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            elif mode.startswith("buffered+range"):
                assert SYNC_FILE_RANGE is not None
                SYNC_FILE_RANGE(fd, 0, 0, _WRITE)
                waiting.append(fd)
                continue
            os.close(fd)
        for pending in waiting:  # the thread's share of the batch is written: wait for all of it
            if mode == "buffered+range batch":
                assert SYNC_FILE_RANGE is not None
                SYNC_FILE_RANGE(pending, 0, 0, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            else:
                os.fdatasync(pending)
            os.close(pending)

    def _read(self, mode: str, jobs: list[int]) -> None:
        bufs = getattr(self.local, "bufs", None)
        if bufs is None:
            bufs = self.local.bufs = [memoryview(mmap.mmap(-1, PAGE)), memoryview(mmap.mmap(-1, self.block))]
        for i in jobs:
            fd = os.open(self.path(mode, i), os.O_RDONLY)
            os.preadv(fd, bufs, 0)
            os.close(fd)

    def _batches(self, work: object, mode: str) -> float:
        start = time.perf_counter()
        for first in range(0, self.count, self.batch):
            jobs = list(range(first, min(self.count, first + self.batch)))
            shares = [jobs[k::self.threads] for k in range(self.threads)]
            list(self.pool.map(work, [mode] * self.threads, shares))
        return time.perf_counter() - start

    def measure(self, mode: str) -> tuple[float, float, float]:
        """(write, write+sync, read back) in MB/s."""
        mb = self.count * (self.block + PAGE) / 1e6
        write = self._batches(self._write, mode)
        start = time.perf_counter()
        os.sync()
        synced = write + time.perf_counter() - start
        read = self._batches(self._read, mode)
        return mb / write, mb / synced, mb / read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", default="256,2048", help="block sizes in KiB (default 256,2048)")
    parser.add_argument("--mib", type=int, default=512, help="MiB written per mode and round (default 512)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the disk under test (default: ./)")
    parser.add_argument("--threads", type=int, default=4, help="I/O threads (default 4, the file tier's)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per batch (default 32)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians shown (default 3)")
    args = parser.parse_args()
    if SYNC_FILE_RANGE is None:
        sys.exit("sync_file_range is not available here (Linux only)")
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for kib in (int(k) for k in args.block_kib.split(",")):
        block = kib * 1024
        count = max(1, args.mib * 1024 * 1024 // block)
        root = Path(tempfile.mkdtemp(prefix="kvtier-wmodes-", dir=args.dir or Path.cwd()))
        run = Run(root, block, count, args.threads, args.batch)
        results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
        cold = True
        try:
            for _ in range(args.repeat):
                for mode in MODES:
                    for entry in os.scandir(root):
                        os.unlink(entry.path)
                    cold = drop_caches() and cold
                    results[mode].append(run.measure(mode))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            run.pool.shutdown()
        print(f"\n{count} blocks of {kib} KiB, {args.threads} threads, batches of {args.batch}"
              f"{'' if cold else ' (no drop_caches: not root)'}")
        print("| mode | write | write+sync | read back |\n|---|---:|---:|---:|")
        for mode, rows in results.items():
            cells = [statistics.median(r[k] for r in rows) for k in range(3)]
            print(f"| {mode} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
