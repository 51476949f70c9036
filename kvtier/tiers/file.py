"""The NVMe / local-disk tier: one self-describing file per block, written atomically, indexed in memory.

Holds far more blocks than host memory, across restarts: each block is one checksummed file
(a 4096-byte header page, then the page-aligned payload) renamed into place, and the in-memory index
is rebuilt from the directory tree at start. It stores what the cache gives it (no eviction of its
own); a corrupt or foreign file is a miss and is removed, an I/O fault a miss or ``False``.
docs/file-tier.md describes the files on disk, the batched data path and the I/O choices.

One module because the pieces share one batch machinery: the I/O threads that drain a batch, the
aligned scratch buffers, the index and its lock, the disk-full capacity tracking and the chain log
are used together by put, get, contains and the start-up scan; split apart they would need the
tier's private state passed back and forth on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from kvtier.blocks import BlockKey, all_of_group
from kvtier.codec import (
    CHECKSUM_OFFSET,
    HEADER_SIZE,
    MAX_HASH_BYTES,
    RawHeaders,
    decode_header,
    decode_payload_into,
    encode_block,
    finish_raw_check,
    lz4_bound,
    start_raw_check,
    verify_payload,
)
from kvtier.errors import CorruptBlock, KVTierConfigError, LayoutMismatch, TierUnavailable
from kvtier.hashing import namespace_fingerprint
from kvtier.hostinfo import usable_cpus
from kvtier.kernels import host
from kvtier.kernels.reader_pool import ReaderPool
from kvtier.layout import BlockLayout
from kvtier.logs import LogLimiter
from kvtier.tiers.base import Tier
from kvtier.tiers.chainlog import FILE_NAME as CHAIN_LOG
from kvtier.tiers.chainlog import ChainLog

log = logging.getLogger(__name__)

#: Alignment of the header page, the payload offset and every file length (and of O_DIRECT buffers).
PAGE = 4096
BLOCK_SUFFIX = ".kvb"
_SUFFIX = BLOCK_SUFFIX.encode()  # (fileread.c builds the block paths)
_BLOCK_HASH, _NBYTES = attrgetter("block_hash"), attrgetter("nbytes")
TMP_SUFFIX = ".tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600
_ZERO_PAGE = bytes(PAGE)
#: how a block file is opened for reading (why: :func:`_open_block`)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14+; elsewhere every read is a plain one
#: A raw block is read and hashed this many bytes at a time, so the checksum reads each piece while it
#: is still in the CPU cache (half the 1 MiB L2 of a core where it was measured: docs/file-tier.md).
READ_CHUNK = 512 * 1024
#: While a full disk keeps the capacity below the configured one, free space is re-checked this often.
DISK_RECHECK_SECONDS = 1.0

Compression = Literal["none", "lz4"]
WriteIO = Literal["direct", "synced", "buffered"]
WRITE_IO_MODES: tuple[WriteIO, ...] = ("direct", "synced", "buffered")
#: ``write_io`` when neither it nor ``direct_io`` is given (why: docs/file-tier.md)
DEFAULT_WRITE_IO: WriteIO = "synced"
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4  # sync_file_range(2) flags (Linux)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; ``os`` does not expose it); ``None`` elsewhere."""
    name = ctypes.util.find_library("c")
    func = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None) if name else None
    if func is None:
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _load_sync_file_range()


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the device; do not wait (``sync_file_range(WRITE)``)."""
    if _SYNC_FILE_RANGE is not None and _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_WRITE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


def _wait_writeback(fd: int) -> None:
    """Return once every page written to ``fd`` has been written to the device.

    ``sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`` writes and waits for the data and nothing
    else (no metadata, no device cache flush), which is what an ``O_DIRECT`` write gives; where it is
    missing, ``fdatasync`` (which gives more)."""
    if _SYNC_FILE_RANGE is None:
        os.fdatasync(fd)
    elif _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


def _part_cuts(n: int, idle: int) -> list[int]:
    """Where to cut a batch of ``n`` reads: one part per idle thread (at least one, at most one per 8
    blocks), as ``[0, ..., n]``."""
    parts = max(1, min(idle, (n + 7) // 8))
    return [n * p // parts for p in range(parts + 1)]


def _round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % PAGE == 0 and array.nbytes % PAGE == 0


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """``pwritev`` until every byte is written (a short write continues where it stopped)."""
    buffers = [b for b in buffers if b.nbytes]
    while buffers:
        written = os.pwritev(fd, buffers, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while buffers and written >= buffers[0].nbytes:
            written -= buffers[0].nbytes
            buffers.pop(0)
        if written:
            buffers[0] = buffers[0][written:]


def _read_all(fd: int, path: str, buffers: list[memoryview]) -> int:
    """``preadv`` from the start until the buffers are full or the file ends; return the bytes read.

    A read that fails on what is not a regular file is :class:`CorruptBlock` (:func:`_refuse_irregular`)."""
    buffers = [b for b in buffers if b.nbytes]
    total = offset = 0
    while buffers:
        try:
            got = os.preadv(fd, buffers, offset)
        except OSError:
            _refuse_irregular(fd, path)
            raise
        if got <= 0:
            break
        total += got
        offset += got
        while buffers and got >= buffers[0].nbytes:
            got -= buffers[0].nbytes
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]
    return total


class _Scratch(NamedTuple):
    """Page-aligned buffers one I/O thread reuses (an anonymous mmap is page aligned)."""

    write_page: memoryview  # only bytes [0, HEADER_SIZE) are ever written: the rest stays zero
    read_page: memoryview
    body: np.ndarray  # a padded compressed payload, or a copy of an unaligned block


class _ShardScan(NamedTuple):
    """What start-up found in one shard directory."""

    blocks: list[tuple[BlockKey, int]]
    invalid: int
    removed_tmp: int


class _WarmJob(NamedTuple):
    """A batch for ``fileread.c``: raw blocks of one group, hash length and size (``FileTier._warm_job``)."""

    picked: Sequence[int]  # their positions in the reads given
    size: int
    prefix: bytes  # the group's directory, then "/": fileread.c adds "<shard>/<hash hex><suffix>"
    hashes: bytes  # their hashes, one after the other
    hash_len: int
    expected: bytes  # the headers they must carry (RawHeaders.of_hashes)
    outs: np.ndarray  # where each goes (uint64 addresses)

    def helper_args(self) -> tuple[Any, ...]:
        """The arguments of :func:`host.read_warm` and :meth:`ReaderPool.submit` for this batch."""
        return (self.prefix, self.hashes, self.hash_len, _SUFFIX, self.outs, self.size, READ_CHUNK,
                self.expected, HEADER_SIZE, CHECKSUM_OFFSET, PAGE)

    def part(self, a: int, z: int) -> _WarmJob:
        """Blocks ``a`` to ``z`` of a job of every block given (slices: no per-block work)."""
        hash_len = self.hash_len
        return _WarmJob(range(z - a), self.size, self.prefix, self.hashes[a * hash_len:z * hash_len],
                        hash_len, self.expected[a * HEADER_SIZE:z * HEADER_SIZE], self.outs[a:z])


#: a part of a batch queued on the native readers: (its first read's position, its job, the future of
#: its blocks' statuses)
_NativeJob = tuple[int, _WarmJob, "asyncio.Future[np.ndarray]"]


class _Outcome(NamedTuple):
    """What one block's I/O did: ``error`` is ``None`` on success, else the counter it goes to."""

    error: str | None
    device_bytes: int = 0


_NOT_RUN = _Outcome("io")  # placeholder of a job a failed or cancelled batch never ran
#: the rest of a job, run by its I/O thread once the batch's queue is empty (a synced write's wait)
_Finish = Callable[[], _Outcome]


def _mark_verified(outcomes: list[_Outcome | None], start: int, job: _WarmJob, status: np.ndarray) -> None:
    """A hit in ``outcomes`` (from ``start``) for each block of ``job`` that ``fileread.c`` verified."""
    good = _Outcome(None, PAGE + job.size)
    for i, code in zip(job.picked, status.tolist(), strict=True):
        if code == 0:
            outcomes[start + i] = good


class FileTier(Tier):
    """Blocks as files under ``root/namespace``; see the module docstring for format and I/O choices.

    ``write_io`` says how a put reaches the disk: ``synced`` (the default: through the page cache, each
    file's write-back started as it is written and waited for before the put returns), ``direct``
    (``O_DIRECT``) or ``buffered`` (written back by the kernel later); ``direct_io`` is its older form
    (``True``: ``direct``, ``False``: ``buffered``). docs/file-tier.md says what each promises.

    Construction creates ``root/namespace`` (0700), probes ``O_DIRECT`` (for ``direct`` writes or
    ``direct_reads``), removes leftover temporary
    files and rebuilds the index by scanning the tree and validating each file's size and header page
    (invalid files are deleted; directories of groups not in ``layouts`` are left alone). It blocks
    for that scan and raises :class:`TierUnavailable` if the directory cannot be created or written, and
    :class:`KVTierConfigError` (key ``path``) if another user could control it: ``root`` or its
    namespace directory a symbolic link or owned by someone else, or ``root`` reached through a
    symbolic link owned by neither this user nor root.

    Operations on one key must not overlap (the cache pins keys in flight); a batch may name a key
    twice, and the last occurrence wins.

    Counters: ``bytes_written`` / ``bytes_read`` are device bytes (header page and padding included,
    compressed sizes under lz4); ``write_seconds`` / ``read_seconds`` are the wall time of whole
    batches. Error kinds: ``enospc``, ``io``, ``missing``, ``corrupt``.
    """

    kind = "file"

    def __init__(self, name: str, layouts: Mapping[int, BlockLayout], capacity_bytes: Mapping[int, int], *,
                 root: str | Path, namespace: str, compression: Compression = "none",
                 direct_io: bool | None = None, write_io: WriteIO | None = None,
                 direct_reads: bool = False, io_threads: int = 4, fsync: bool = False,
                 namespace_fp: int | None = None) -> None:
        super().__init__(name, layouts, capacity_bytes)
        if compression not in ("none", "lz4"):
            raise KVTierConfigError("compression", f"must be 'none' or 'lz4', got {compression!r}")
        if write_io is not None and write_io not in WRITE_IO_MODES:
            raise KVTierConfigError("write_io",
                                    f"must be one of {', '.join(WRITE_IO_MODES)}, got {write_io!r}")
        if write_io is not None and direct_io is not None and direct_io != (write_io == "direct"):
            raise KVTierConfigError("write_io",
                                    f"{write_io} contradicts direct_io={direct_io}; give one of them")
        if write_io is None:
            write_io = DEFAULT_WRITE_IO if direct_io is None else "direct" if direct_io else "buffered"
        if not namespace or namespace in (".", "..") or "/" in namespace or "\0" in namespace:
            raise KVTierConfigError("namespace", f"{namespace!r} is not a usable directory name")
        if io_threads < 1:
            raise KVTierConfigError("io_threads", f"must be at least 1, got {io_threads}")
        self.root = Path(os.path.abspath(root))  # the path checked below is the path used
        self.namespace = namespace
        self.directory = self.root / namespace
        self._directory = str(self.directory)
        self.compression: Compression = compression
        self.direct_reads = direct_reads
        self.fsync = fsync
        #: how writes go to the disk (see :attr:`write_io_active` for what they do now)
        self.write_io: WriteIO = write_io
        self._direct = write_io == "direct"
        #: O_DIRECT reads (``direct_reads``), whatever the write mode, until the filesystem refuses O_DIRECT
        self._direct_reads = direct_reads
        #: buffered writes wait for their write-back before the put returns (``synced``, or a
        #: ``direct`` tier whose filesystem refused O_DIRECT)
        self._synced = write_io != "buffered"
        #: first try each read from the page cache alone (see :meth:`_read_cached_block`)
        self._nowait = _RWF_NOWAIT != 0 and hasattr(os, "posix_fadvise")
        self._fingerprints = {gid: layout.fingerprint() for gid, layout in self.layouts.items()}
        #: written into every header and checked on every read: a block of another namespace is corrupt
        self.namespace_fp = namespace_fingerprint(namespace) if namespace_fp is None else namespace_fp
        #: what a raw block's header must be, byte for byte (the fast check of a read)
        self._raw_headers = {gid: RawHeaders(self._fingerprints[gid], layout.nbytes, self.namespace_fp)
                             for gid, layout in self.layouts.items()}
        self._itemsize = {gid: layout.itemsize for gid, layout in self.layouts.items()}
        self._block_nbytes = {gid: layout.nbytes for gid, layout in self.layouts.items()}
        self._raw_file_size = {gid: PAGE + _round_up(layout.nbytes) for gid, layout in self.layouts.items()}
        self._max_file_size = {gid: PAGE + _round_up(lz4_bound(layout.nbytes))
                               for gid, layout in self.layouts.items()}
        self._body_bytes = max((size - PAGE for size in self._max_file_size.values()), default=PAGE)
        self._local = threading.local()
        self._corrupt_log = LogLimiter(log, f"corrupt blocks dropped by file tier {name!r}")
        self._capacity_log = LogLimiter(log, f"capacity changes of file tier {name!r}")
        self._lock = threading.Lock()  # orders index updates with the rename/unlink they describe
        self._index: dict[BlockKey, int] = {}
        self._blocks_per_group = dict.fromkeys(self.layouts, 0)
        #: what the config asked for; ``capacity_bytes`` is what the disk holds now (a full disk shrinks it)
        self.configured_capacity_bytes = dict(self.capacity_bytes)
        self._disk_checked_at = float("-inf")
        self._made_dirs: set[str] = set()
        self._io_threads = io_threads
        self._make_pools()
        #: warm raw blocks are read a batch per call by the native helper (kvtier/kernels/fileread.c)
        self._native_reads = host.reads_available()
        #: native reader threads for the warm reads (one per read-pool thread), started on first use
        self._readers = ReaderPool(self._pool_threads[self._read_executor]) if self._native_reads else None
        self._native_jobs_in_flight = 0  # batches queued on ``_readers`` (event loop's thread only)
        try:
            self._make_dir(self.root, parents=True)
            self._refuse_unsafe(self.root, ancestors=True)
            self._make_dir(self.directory)
            self._refuse_unsafe(self.directory, ancestors=False)
            if self._direct or self._direct_reads:
                self._probe_direct_io()
            self._scan()
            self._chains = ChainLog(self.directory / CHAIN_LOG)
        except OSError as exc:
            self._shutdown(wait=False)
            raise TierUnavailable(f"file tier {name!r} cannot use {self.directory}: {exc}") from exc
        except KVTierConfigError:
            self._shutdown(wait=False)
            raise

    # --- public API ------------------------------------------------------------------------------
    @property
    def direct_io_active(self) -> bool:
        """Whether writes use ``O_DIRECT`` now (reads do with ``direct_reads``, in every write mode)."""
        return self._direct

    @property
    def write_io_active(self) -> WriteIO:
        """How writes go to the disk now: ``write_io``, or ``synced`` where O_DIRECT was refused."""
        return "direct" if self._direct else "synced" if self._synced else "buffered"

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Write each block to its file (temp + rename); the I/O threads share the batch
        (:meth:`_on_io_threads`).

        Called by the cache after it made room; blocks on nothing but the I/O threads. A block whose
        write fails (ENOSPC, EIO, any OSError) is ``False``: no temporary file is left and any older
        version of that key is deleted. Raises only :class:`LayoutMismatch` for wrong buffers and
        ``ValueError`` for a block hash that is not ``bytes`` of at most 64 (before any I/O).
        """
        self.check_buffers(keys, blocks, "blocks")
        for key in keys:
            if type(key.block_hash) is not bytes or len(key.block_hash) > MAX_HASH_BYTES:
                raise ValueError(f"a block hash must be at most {MAX_HASH_BYTES} bytes, "
                                 f"got {key.block_hash!r:.80}")
        arrays = [self._host_array(block, "blocks") for block in blocks]
        last = {key: i for i, key in enumerate(keys)}
        start = time.perf_counter()
        outcomes = await self._on_io_threads(self._write_block, [(key, arrays[i]) for key, i in last.items()])
        self.counters.write_seconds += time.perf_counter() - start
        by_key = dict(zip(last, outcomes, strict=True))
        for outcome in outcomes:
            self._count_write(outcome)
        disk_full = any(outcome.error == "enospc" for outcome in outcomes)
        if disk_full or (self.capacity_bytes != self.configured_capacity_bytes
                         and time.monotonic() - self._disk_checked_at >= DISK_RECHECK_SECONDS):
            self._fit_disk(disk_full)
        self._log_over_capacity(last)
        return [by_key[key].error is None for key in keys]

    async def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor] | torch.Tensor) -> list[bool]:
        """Read each indexed block into ``out[i]``; the I/O threads share the batch (:meth:`_on_io_threads`).

        ``out``: one 1-D uint8 tensor per key, or one ``[n, nbytes]`` uint8 tensor whose rows receive
        the keys' blocks (keys of one group; what the cache passes for a run of its caller's rows):
        checked once instead of once per block.

        Called by the cache to load hits; a key not in the index is a miss without any I/O. A missing
        file is a miss (dropped from the index); a corrupt or truncated one is a miss and deleted; an
        I/O error is a miss that keeps the file. Raises only :class:`LayoutMismatch` for wrong buffers.
        """
        if isinstance(out, torch.Tensor):
            hits = await self._get_rows_natively(keys, out)
            if hits is not None:
                return hits
        slots, reads, addresses = self._read_jobs(keys, out)
        start = time.perf_counter()
        # the read pool where a read can tell the page cache from the disk (not: O_DIRECT, no RWF_NOWAIT)
        if self._nowait and not self._direct_reads:
            if self._native_reads and _syscalls_unwrapped():
                outcomes = await self._read_natively(reads, addresses)
            else:
                outcomes = await self._on_io_threads(self._read_cached_block, reads, self._read_block,
                                                     executor=self._read_executor)
        else:
            outcomes = await self._on_io_threads(self._read_cached_block, reads, self._read_block)
        self.counters.read_seconds += time.perf_counter() - start
        hits = [False] * len(keys)
        self._count_reads(hits, slots, outcomes)
        return hits

    def _count_reads(self, hits: list[bool], slots: Sequence[int], outcomes: Sequence[_Outcome]) -> None:
        """Mark ``hits[slots[i]]`` where ``outcomes[i]`` succeeded and count every outcome: blocks and
        bytes read, or its error's counter."""
        counters = self.counters
        read = nbytes = 0
        for i, outcome in zip(slots, outcomes, strict=True):
            if outcome.error is None:
                hits[i] = True
                read += 1
                nbytes += outcome.device_bytes
            else:
                counters.error(outcome.error)
        counters.blocks_read += read
        counters.bytes_read += nbytes

    async def _get_rows_natively(self, keys: Sequence[BlockKey], out: torch.Tensor) -> list[bool] | None:
        """:meth:`get` of the usual load, handled as one batch: every key indexed as a raw block of one
        group, ``out`` the ``[n, nbytes]`` rows the cache passes, the native readers serving this loop.

        The batch goes to the readers as arrays (hashes, headers, row addresses), with no object per
        block on the event loop's thread (those were most of its work per block, and the garbage
        collections they set off); a block the readers do not verify is read :meth:`_read_natively`'s
        long way. None, having done nothing, for any other batch.
        """
        readers = self._readers
        n = len(keys)
        if (readers is None or not n or self._direct_reads or not (self._nowait and self._native_reads)
                or not _syscalls_unwrapped()):
            return None
        if not self._is_row_batch(keys, out):
            return None
        group, size = keys[0].group_id, out.shape[1]
        raw_size = self._raw_file_size[group]
        if list(map(self._index.get, keys)).count(raw_size) != n:
            return None  # a key not indexed, or a compressed block
        hashes = list(map(_BLOCK_HASH, keys))
        hash_len = len(hashes[0])
        if set(map(len, hashes)) != {hash_len}:
            return None
        start = time.perf_counter()
        base = out.data_ptr()
        job = _WarmJob(range(n), size, f"{self._group_dir(group)}/".encode(), b"".join(hashes), hash_len,
                       self._raw_headers[group].of_hashes(group, hashes),
                       np.arange(base, base + size * n, size, dtype=np.uint64))
        cuts = _part_cuts(n, readers.threads - self._native_jobs_in_flight)
        queued: list[tuple[int, int, asyncio.Future[np.ndarray]]] = []
        for a, z in zip(cuts, cuts[1:], strict=False):
            future = readers.submit(*job.part(a, z).helper_args())
            if future is None:  # the pool cannot serve this loop (or it is stopping)
                if not queued:
                    return None
                continue  # (this part's blocks are read the long way)
            queued.append((a, z, future))
        statuses = await self._await_parts([future for _, _, future in queued])
        status = np.ones(n, dtype=np.int32)  # (a part not queued: every block the long way)
        for (a, z, _), part in zip(queued, statuses, strict=True):
            status[a:z] = part
        rest = np.flatnonzero(status).tolist()
        counters = self.counters
        read = n - len(rest)
        counters.blocks_read += read
        counters.bytes_read += read * (PAGE + size)
        if not rest:
            counters.read_seconds += time.perf_counter() - start
            return [True] * n
        hits = [True] * n
        for i in rest:
            hits[i] = False
        rows = out.numpy()
        reads = [(keys[i], raw_size, rows[i]) for i in rest]
        later = await self._on_io_threads(self._read_cached_block, reads, self._read_block,
                                          executor=self._read_executor)
        counters.read_seconds += time.perf_counter() - start
        self._count_reads(hits, rest, later)
        return hits

    async def _await_parts(self, futures: list[asyncio.Future[np.ndarray]]) -> list[np.ndarray]:
        """The statuses of the parts queued on the native readers. A cancelled call returns only once no
        reader thread touches the parts' buffers."""
        if not futures:
            return []
        self._native_jobs_in_flight += len(futures)
        try:
            return await asyncio.shield(asyncio.gather(*futures))
        except BaseException:
            await asyncio.wait(futures)
            raise
        finally:
            self._native_jobs_in_flight -= len(futures)

    async def _read_natively(self, reads: list[tuple[BlockKey, int, np.ndarray]], addresses: list[int],
                             ) -> list[_Outcome]:
        """Read the warm raw blocks of a batch with the native helper, the rest as :meth:`get` otherwise does.

        The batch is cut into parts, each one call into ``fileread.c``: on the tier's native reader
        threads (:class:`ReaderPool`) where they serve this event loop, else one part per idle thread of
        the read pool (at least one, at most one per 8 blocks) with the GIL released. It reads and
        verifies the blocks it finds whole in the page cache and asks the kernel for the others. What
        it did not verify (cold, missing, corrupt, compressed, an error) then takes the Python path,
        which reads it again and sorts every case out: the helper only ever says "this block is good".
        As in :meth:`_on_io_threads`, a cancelled call returns only once no thread touches ``out``.
        """
        if not reads:
            return []
        pool = self._read_executor
        n = len(reads)
        outcomes: list[_Outcome | None]
        queued = self._read_on_native_threads(reads, addresses)
        if queued is not None:
            outcomes = await queued
        else:
            cuts = _part_cuts(n, self._pool_threads[pool] - self._tasks_in_flight[pool])
            parts = len(cuts) - 1
            loop = asyncio.get_running_loop()
            self._tasks_in_flight[pool] += parts
            futures = [loop.run_in_executor(pool, self._read_warm_part, reads[a:z], addresses[a:z])
                       for a, z in zip(cuts, cuts[1:], strict=False)]
            try:
                done = await asyncio.shield(asyncio.gather(*futures))
            except BaseException:  # cancelled (or a bug): let no thread outlive the call
                await asyncio.wait(futures)
                raise
            finally:
                self._tasks_in_flight[pool] -= parts
            outcomes = [outcome for part in done for outcome in part]
        rest = [i for i, outcome in enumerate(outcomes) if outcome is None]
        if rest:
            later = await self._on_io_threads(self._read_cached_block, [reads[i] for i in rest],
                                              self._read_block, executor=pool)
            for i, outcome in zip(rest, later, strict=True):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]  # (every None replaced above)

    def _read_on_native_threads(self, reads: list[tuple[BlockKey, int, np.ndarray]], addresses: list[int],
                                ) -> Awaitable[list[_Outcome | None]] | None:
        """Queue the batch on the native reader threads (:class:`ReaderPool`), one part per idle
        reader (at most one per 8 blocks); None where they cannot take it (then: the read pool)."""
        readers = self._readers
        if readers is None:
            return None
        n = len(reads)
        cuts = _part_cuts(n, readers.threads - self._native_jobs_in_flight)
        jobs: list[_NativeJob] = []
        for a, z in zip(cuts, cuts[1:], strict=False):
            job = self._warm_job(reads[a:z], addresses[a:z])
            if job is None:
                continue
            future = readers.submit(*job.helper_args())
            if future is None:  # the pool cannot serve this loop (or it is stopping)
                if not jobs:
                    return None
                continue  # (this part's blocks are read the long way)
            jobs.append((a, job, future))
        return self._native_outcomes(n, jobs)

    async def _native_outcomes(self, n: int, jobs: list[_NativeJob]) -> list[_Outcome | None]:
        """Wait for the queued parts: an outcome per verified block, None for the rest. A cancelled
        call returns only once no reader thread touches ``out``."""
        outcomes: list[_Outcome | None] = [None] * n
        statuses = await self._await_parts([future for _, _, future in jobs])
        for (start, job, _), status in zip(jobs, statuses, strict=True):
            _mark_verified(outcomes, start, job, status)
        return outcomes

    def _read_warm_part(self, reads: list[tuple[BlockKey, int, np.ndarray]], addresses: list[int],
                        ) -> list[_Outcome | None]:
        """One native call for the raw blocks of ``reads`` (:meth:`_warm_job`): their outcomes where
        verified, None for every other read (on an I/O thread)."""
        outcomes: list[_Outcome | None] = [None] * len(reads)
        job = self._warm_job(reads, addresses)
        if job is None:
            return outcomes
        status = host.read_warm(*job.helper_args())
        if status is None:
            self._native_reads = False
            return outcomes
        _mark_verified(outcomes, 0, job, status)
        return outcomes

    def _warm_job(self, reads: list[tuple[BlockKey, int, np.ndarray]], addresses: list[int],
                  ) -> _WarmJob | None:
        """What ``fileread.c`` needs for the raw blocks of ``reads`` (at ``addresses``) of the first
        one's group, hash length and size; None if there are none."""
        first_key, _, first = reads[0]
        group, hash_len, size = first_key.group_id, len(first_key.block_hash), first.nbytes
        raw_size = self._raw_file_size[group]
        keys, sizes, arrays = zip(*reads, strict=True)
        hashes = list(map(_BLOCK_HASH, keys))
        if (sizes.count(raw_size) == len(reads) and set(map(len, hashes)) == {hash_len}
                and all_of_group(keys, group) and set(map(_NBYTES, arrays)) == {size}):
            picked = list(range(len(reads)))  # the usual batch: all raw, of one group and size
            outs = np.array(addresses, dtype=np.uint64)
        else:
            picked = [i for i, (key, file_size, array) in enumerate(reads)
                      if file_size == raw_size and key.group_id == group and len(key.block_hash) == hash_len
                      and array.nbytes == size]
            if not picked:
                return None
            hashes = [hashes[i] for i in picked]
            outs = np.array([addresses[i] for i in picked], dtype=np.uint64)
        return _WarmJob(picked, size, f"{self._group_dir(group)}/".encode(), b"".join(hashes), hash_len,
                        self._raw_headers[group].of_hashes(group, hashes), outs)

    def _read_jobs(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor] | torch.Tensor,
                   ) -> tuple[list[int], list[tuple[BlockKey, int, np.ndarray]], list[int]]:
        """Check ``out`` and list the indexed keys' reads: (their positions, ``(key, file size, array)``,
        each array's address for the native reader).

        One pass over the batch on the event loop's thread (it holds the GIL the I/O threads want). The
        checks are :meth:`check_buffers`'s and :meth:`_host_array`'s; on anything the pass refuses,
        those run themselves and raise their own :class:`LayoutMismatch`.
        """
        index_get = self._index.get  # (one lookup per key: I/O threads may drop keys meanwhile)
        slots: list[int] = []
        reads: list[tuple[BlockKey, int, np.ndarray]] = []
        if isinstance(out, torch.Tensor):
            if self._is_row_batch(keys, out):
                rows, base, stride = out.numpy(), out.data_ptr(), out.shape[1]
                sizes = list(map(index_get, keys))
                if None not in sizes:  # the usual load: every key indexed, the batch in C-level passes
                    reads = list(zip(keys, sizes, rows, strict=True))  # type: ignore[arg-type]
                    return list(range(len(keys))), reads, list(range(base, base + stride * len(keys), stride))
                for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                    if size is not None:
                        slots.append(i)
                        reads.append((key, size, rows[i]))
                return slots, reads, [base + stride * i for i in slots]
            out = list(out.unbind(0)) if out.dim() > 1 else [out]
        if len(keys) == len(out):
            nbytes = self._block_nbytes
            uint8 = torch.uint8
            addresses: list[int] = []
            for i, (key, buf) in enumerate(zip(keys, out, strict=True)):
                if (buf.dtype != uint8 or buf.dim() != 1 or buf.numel() != nbytes.get(key.group_id)
                        or not buf.is_contiguous() or buf.device.type != "cpu"):
                    break
                if (size := index_get(key)) is not None:
                    slots.append(i)
                    reads.append((key, size, buf.numpy()))
                    addresses.append(buf.data_ptr())
            else:
                return slots, reads, addresses
        # a buffer the one-pass check refused: the full checks raise their own error naming it
        self.check_buffers(keys, out, "out")
        arrays = [self._host_array(buf, "out") for buf in out]
        indexed = [(i, key, size) for i, key in enumerate(keys) if (size := index_get(key)) is not None]
        return ([i for i, _, _ in indexed], [(key, size, arrays[i]) for i, key, size in indexed],
                [arrays[i].ctypes.data for i, _, _ in indexed])

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Answer from the in-memory index, without I/O (a ``get`` may still miss on a damaged file)."""
        return [key in self._index for key in keys]

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """Unlink the keys' files on the I/O threads; absent keys are ignored, failures counted (``io``)."""
        present = [key for key in dict.fromkeys(keys) if key in self._index]
        outcomes = await self._on_io_threads(self._delete_block, [(key,) for key in present])
        for outcome in outcomes:
            if outcome.error is not None:
                self.counters.error(outcome.error)

    def chain_links(self) -> dict[BlockKey, BlockKey]:
        """Recorded predecessors of the indexed blocks (:mod:`kvtier.tiers.chainlog`)."""
        with self._lock:
            present = set(self._index)
        return self._chains.load(present)

    def record_links(self, links: Sequence[tuple[BlockKey, BlockKey]]) -> None:
        self._chains.append(links)

    def keys(self) -> Iterator[BlockKey]:
        """A snapshot of the indexed keys (safe while I/O is in flight)."""
        with self._lock:
            return iter(list(self._index))

    def usage_bytes(self) -> int:
        """Indexed blocks × their group's raw block bytes (what they hold, not what they take on disk)."""
        with self._lock:
            return sum(count * self.layouts[gid].nbytes for gid, count in self._blocks_per_group.items())

    async def close(self) -> None:
        """Wait for in-flight I/O on a helper thread, then stop the I/O threads."""
        await asyncio.to_thread(self._shutdown, True)
        if self._readers is not None:
            self._readers.close()
        self._corrupt_log.flush()
        self._capacity_log.flush()

    def _make_pools(self) -> None:
        """The I/O thread pools, with nothing in flight (at construction, and again in a forked child)."""
        name, io_threads = self.name, self._io_threads
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvtier-file-{name}")
        # Reads from the page cache are CPU work (a copy and a checksum), so more reading threads than
        # CPUs only add hand-overs of the GIL between them: reads get a pool of at most one thread
        # per usable CPU. A cold batch goes back to the full pool (:meth:`_on_io_threads`).
        read_threads = min(io_threads, usable_cpus())
        self._read_executor = self._executor if read_threads == io_threads else ThreadPoolExecutor(
            read_threads, thread_name_prefix=f"kvtier-file-{name}-read")
        self._pool_threads = {self._executor: io_threads, self._read_executor: read_threads}
        #: executor tasks of the batches in flight per pool (counted on the event loop's thread only)
        self._tasks_in_flight = dict.fromkeys(self._pool_threads, 0)
        #: tasks the read pool handed to the full pool (cold reads), counted on the I/O threads
        self._handed_in_flight = 0
        self._handed_lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        """The parent's I/O threads are not in the child (a get there waited for them forever): new
        pools and locks; the native readers start their own threads on first use (ReaderPool)."""
        super().after_fork_in_child()
        self._make_pools()
        self._lock = threading.Lock()
        self._native_jobs_in_flight = 0

    def _shutdown(self, wait: bool) -> None:
        if self._readers is not None:  # (its batches are short: it finishes them even without ``wait``)
            self._readers.stop()
        # the read pool first: a read in flight may still hand its cold blocks to the full pool
        self._read_executor.shutdown(wait)
        self._executor.shutdown(wait)

    def _fit_disk(self, disk_full: bool) -> None:
        """Make ``capacity_bytes`` what the disk can hold: the blocks held plus what fits in the free space
        (``statvfs``), never above the configured capacity, at least one block per group.

        After ENOSPC the cache then evicts to stay within it and the tier keeps storing, instead of
        failing every write while older blocks hold the disk. Called on ENOSPC, and (while shrunk) at most
        every ``DISK_RECHECK_SECONDS`` on a put, so the capacity grows back when space frees up. When
        ``statvfs`` sees room that a write was refused (a quota, reserved blocks), the capacity is cut to
        the blocks held.
        """
        self._disk_checked_at = time.monotonic()
        try:
            info = os.statvfs(self._directory)
        except OSError as exc:
            log.debug("file tier %r: statvfs failed: %s", self.name, exc)
            return
        free = info.f_bavail * info.f_frsize
        with self._lock:
            held = dict(self._blocks_per_group)
        configured = self.configured_capacity_bytes
        total = sum(configured.values()) or 1
        refused_with_room = disk_full and free >= max(self._max_file_size.values(), default=0)
        fitted: dict[int, int] = {}
        for gid, limit in configured.items():
            nbytes = self.layouts[gid].nbytes
            room = 0 if refused_with_room else int(free * limit / total) // self._raw_file_size[gid]
            blocks = max(1, held.get(gid, 0) + room)
            fitted[gid] = min(limit, blocks * nbytes)
            if not disk_full:  # a re-check only grows: shrinking waits for the disk to say it is full
                fitted[gid] = max(fitted[gid], self.capacity_bytes.get(gid, 0))
        if fitted == self.capacity_bytes:
            return
        before = sum(self.capacity_bytes.values())
        self.capacity_bytes = fitted
        self.capacity_version += 1
        after, wanted = sum(fitted.values()), sum(configured.values())
        if after < before:
            self._capacity_log.log("file tier %r: the disk under %s is full; effective capacity %d → %d "
                                   "bytes (configured %d): older blocks are evicted to keep storing",
                                   self.name, self.directory, before, after, wanted)
        else:
            self._capacity_log.log("file tier %r: disk space came back; effective capacity %d → %d bytes "
                                   "(configured %d)", self.name, before, after, wanted)

    async def _on_io_threads(self, work: Callable[..., _Outcome | _Finish | None],
                             jobs: list[tuple[Any, ...]],
                             later: Callable[..., _Outcome | None] | None = None,
                             executor: ThreadPoolExecutor | None = None) -> list[_Outcome]:
        """Run ``work(*job)`` for every job on the I/O threads: one executor task per thread, not per block.

        ``work`` may return ``None`` to put a job off: the thread runs ``later(*job)`` for it once the
        shared queue is empty (cold reads: see :meth:`_read_cached_block`). It may also return the
        rest of the job as a function, which the thread runs once the queue is empty even if the call
        was cancelled (a synced write waits for its write-back, then renames: see :meth:`_write_block`).
        On ``executor`` (the read pool, smaller than ``io_threads``), the first job put off hands the
        rest of the queue to the full pool: a cold read waits on the disk, not on a CPU.

        Up to one task per thread of the pool drains one shared queue (``deque.popleft`` is atomic), so
        a slow file holds up only its own thread and a batch costs a few futures instead of one per
        block (about 120 µs each, measured, when every block went through asyncio and the pool). If the
        caller is cancelled, the threads take no further jobs and the call waits for the ones running,
        so that no thread reads or writes the caller's buffers after the call has ended (the same after a
        bug in ``work``, which is raised).
        """
        if not jobs:
            return []
        queue = deque(enumerate(jobs))
        outcomes: list[_Outcome] = [_NOT_RUN] * len(jobs)
        stop = threading.Event()
        pool = executor or self._executor
        small_pool = later is not None and pool is not self._executor
        #: the full pool's tasks that took over from the small pool (see ``hand_to_full_pool``)
        joined: list[Future[None]] = []
        join_lock = threading.Lock()

        def hand_to_full_pool(index: int, job: tuple[Any, ...]) -> bool:
            # A block put off means a cold batch: its opens and reads wait on the disk, not on a CPU.
            # The first time, the full pool takes the rest of the queue, this block again included,
            # and the small pool's thread moves on to the next batch (which then puts its own cold
            # reads in flight). After that (``False``) the thread keeps its block, as the full pool may
            # have emptied the queue and finished already.
            with join_lock:
                if joined or stop.is_set():
                    return False
                queue.append((index, job))
                with self._handed_lock:  # as many tasks as leave threads idle, at least one (as below)
                    busy = self._tasks_in_flight[self._executor] + self._handed_in_flight
                    tasks = max(1, min(len(queue), self._io_threads - busy))
                    self._handed_in_flight += tasks
                joined.extend(self._executor.submit(handed_drain) for _ in range(tasks))
                return True

        def handed_drain() -> None:
            try:
                drain(False)
            finally:
                with self._handed_lock:
                    self._handed_in_flight -= 1

        def drain(on_small_pool: bool) -> None:
            deferred: list[tuple[int, tuple[Any, ...]]] = []
            finishing: list[tuple[int, _Finish]] = []
            try:
                while not stop.is_set() and not (on_small_pool and joined):  # (the full pool has the rest)
                    try:
                        index, job = queue.popleft()
                    except IndexError:
                        break
                    outcome = work(*job)
                    if outcome is None:
                        if on_small_pool and hand_to_full_pool(index, job):
                            break
                        deferred.append((index, job))
                    elif isinstance(outcome, _Outcome):
                        outcomes[index] = outcome
                    else:
                        finishing.append((index, outcome))
            finally:  # started writes are finished (or discarded) whatever happens
                for index, finish in finishing:
                    outcomes[index] = finish()
            for index, job in deferred:
                if stop.is_set() or later is None:
                    return
                outcomes[index] = later(*job) or _NOT_RUN

        loop = asyncio.get_running_loop()
        # As many tasks as the batches already in flight leave threads idle, at least one: a batch
        # that arrives while every thread is taken queues behind them as one task, not io_threads
        # (each executor task costs a wake-up of a thread and of the loop).
        tasks = max(1, min(len(jobs), self._pool_threads[pool] - self._tasks_in_flight[pool]))
        self._tasks_in_flight[pool] += tasks
        futures = [loop.run_in_executor(pool, drain, small_pool) for _ in range(tasks)]
        try:
            await asyncio.shield(asyncio.gather(*futures))
            # every join happened inside a task awaited above: ``joined`` is complete here
            await asyncio.shield(asyncio.gather(*map(asyncio.wrap_future, joined)))
        except BaseException:  # cancelled (or a bug in ``work``): stop, and let no thread outlive the call
            stop.set()
            with join_lock:  # no join after this
                waiting = [*futures, *map(asyncio.wrap_future, joined)]
            await asyncio.wait(waiting)
            raise
        finally:
            self._tasks_in_flight[pool] -= tasks
        return outcomes

    # --- paths and directories ---------------------------------------------------------------------
    def path_of(self, key: BlockKey) -> Path:
        """Where ``key``'s block lives (whether or not it is stored)."""
        return Path(self._block_path(key))

    def _block_path(self, key: BlockKey) -> str:
        """:meth:`path_of` as a plain string (the read paths')."""
        shard, hex_hash = self._locate(key)
        return f"{shard}/{hex_hash}{BLOCK_SUFFIX}"

    def _locate(self, key: BlockKey) -> tuple[str, str]:
        """``(shard directory, hash hex)`` of a key: plain strings, the hot path avoids pathlib.
        (``fileread.c``'s ``block_path`` builds the same path for the native reads.)"""
        hex_hash = key.block_hash.hex()
        return f"{self._group_dir(key.group_id)}/{hex_hash[:2] or '00'}", hex_hash

    def _group_dir(self, group_id: int) -> str:
        """A group's directory: ``<namespace dir>/g<group id>`` (:meth:`_parse_group` reads it back)."""
        return f"{self._directory}/g{group_id}"

    def _make_dir(self, path: str | Path, parents: bool = False) -> None:
        if parents:
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)

    def _refuse_unsafe(self, directory: Path, *, ancestors: bool) -> None:
        """Raise :class:`KVTierConfigError` for a directory another user could control.

        Refused: ``directory`` itself a symbolic link or not owned by this user; with ``ancestors``, a
        path through a symbolic link owned by neither this user nor root (root's own links, like
        macOS's ``/var``, are system layout). Whoever controls the cache directory can read the KV
        cache (the prompts, in another form) or plant blocks in it: the checksum catches damage, not
        forgery.
        """
        euid = os.geteuid()
        if ancestors:
            current = Path(directory.anchor)
            for part in directory.parts[1:-1]:
                current = current / part
                info = os.lstat(current)
                if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, euid):
                    raise KVTierConfigError("path", f"{self.root} is reached through the symbolic link "
                                                    f"{current}, owned by uid {info.st_uid}; "
                                                    f"give a path without it")
        info = os.lstat(directory)
        if stat.S_ISLNK(info.st_mode):
            raise KVTierConfigError("path", f"{directory} is a symbolic link (to {os.readlink(directory)}); "
                                            f"give the directory itself")
        if info.st_uid != euid:
            raise KVTierConfigError("path", f"{directory} is owned by uid {info.st_uid}, not by this user "
                                            f"(uid {euid}): another user could read the cache or plant "
                                            f"blocks in it; use a directory of your own")

    def _ensure_dirs(self, shard: str) -> None:
        if shard in self._made_dirs:
            return
        try:
            self._make_dir(os.path.dirname(shard))
        except FileNotFoundError:  # the namespace directory was removed under the tier: make it again
            self._make_dir(self.directory)  # (not the root: whoever made it again there may not be us)
            self._make_dir(os.path.dirname(shard))
        self._make_dir(shard)
        self._made_dirs.add(shard)

    # --- O_DIRECT ------------------------------------------------------------------------------------
    def _disable_direct(self, where: str | Path, exc: OSError) -> None:
        if self._direct or self._direct_reads:
            instead = ("writing through the page cache and waiting for the write-back instead" if self._direct
                       else "reading through the page cache instead")
            log.warning("file tier %r: O_DIRECT is not supported under %s (%s); %s",
                        self.name, where, exc.strerror or exc, instead)
        self._direct = self._direct_reads = False

    def _probe_direct_io(self) -> None:
        probe = self.directory / f".probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        page = mmap.mmap(-1, PAGE)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._disable_direct(self.directory, exc)
            return
        try:
            os.pwritev(fd, [page], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._disable_direct(self.directory, exc)
        finally:
            os.close(fd)
            os.unlink(probe)
            page.close()

    def _scratch(self) -> _Scratch:
        scratch: _Scratch | None = getattr(self._local, "scratch", None)
        if scratch is None:
            body = mmap.mmap(-1, self._body_bytes)
            scratch = _Scratch(memoryview(mmap.mmap(-1, PAGE)), memoryview(mmap.mmap(-1, PAGE)),
                               np.frombuffer(body, dtype=np.uint8))
            self._local.scratch = scratch
        return scratch

    # --- block I/O (runs on the executor threads) ---------------------------------------------------
    def _write_block(self, key: BlockKey, raw: np.ndarray) -> _Outcome | _Finish:
        """Write ``key``'s temporary file; rename it into place now, or (synced buffered writes) return
        the rest as a function, after starting the file's write-back.

        The I/O thread runs that function once it has written its share of the batch: the write-backs
        of its files are then in flight together, and each wait finds its file mostly written.
        """
        shard, hex_hash = self._locate(key)
        final = f"{shard}/{hex_hash}{BLOCK_SUFFIX}"
        tmp = f"{shard}/.{hex_hash}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            header, payload = encode_block(key, self._fingerprints[key.group_id], raw,
                                           namespace_fp=self.namespace_fp, compress=self.compression == "lz4",
                                           shuffle_itemsize=self._itemsize[key.group_id])
            file_size = PAGE + _round_up(payload.nbytes)
            scratch = self._scratch()
            scratch.write_page[:HEADER_SIZE] = header
            fd, direct = self._write_file(shard, tmp, self._write_buffers(scratch, payload, raw))
        except OSError as exc:
            return self._write_failed(key, final, tmp, exc)
        if direct or not self._synced:
            return self._finish_write(key, fd, tmp, final, file_size, wait=False)
        try:
            _start_writeback(fd)
        except OSError as exc:
            os.close(fd)
            return self._write_failed(key, final, tmp, exc)
        return lambda: self._finish_write(key, fd, tmp, final, file_size, wait=True)

    def _finish_write(self, key: BlockKey, fd: int, tmp: str, final: str, file_size: int, *,
                      wait: bool) -> _Outcome:
        """Wait for the write-back (``wait``), fsync if configured, close, rename into place, index."""
        try:
            try:
                if wait:
                    _wait_writeback(fd)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.rename(tmp, final)
                self._index_set(key, file_size)
            if self.fsync:
                self._fsync_dir(os.path.dirname(final))
            return _Outcome(None, file_size)
        except OSError as exc:
            return self._write_failed(key, final, tmp, exc)

    def _write_failed(self, key: BlockKey, final: str, tmp: str, exc: OSError) -> _Outcome:
        self._discard_failed_write(key, final, tmp)
        kind = "enospc" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
        log.debug("file tier %r: storing %s failed: %s", self.name, key, exc)
        return _Outcome(kind)

    def _write_buffers(self, scratch: _Scratch, payload: memoryview, raw: np.ndarray) -> list[memoryview]:
        """The iovecs of a file: header page, payload, zero padding; page-aligned ones under O_DIRECT."""
        size = payload.nbytes
        padded = _round_up(size)
        stored_raw = np.may_share_memory(np.frombuffer(payload, dtype=np.uint8), raw)
        if not self._direct:
            return [scratch.write_page, payload, memoryview(_ZERO_PAGE)[:padded - size]]
        if stored_raw and _aligned(raw):
            return [scratch.write_page, payload]
        body = scratch.body
        np.copyto(body[:size], np.frombuffer(payload, dtype=np.uint8))
        body[size:padded] = 0
        return [scratch.write_page, body[:padded].data]

    def _write_file(self, shard: str, tmp: str, buffers: list[memoryview]) -> tuple[int, bool]:
        """Create ``tmp`` and write ``buffers`` to it; return the open descriptor and whether it was
        written with O_DIRECT (an O_DIRECT refusal switches the tier to buffered writes and retries)."""
        self._ensure_dirs(shard)
        while True:
            direct = self._direct
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(tmp, flags, FILE_MODE)
            except FileNotFoundError:
                self._made_dirs.discard(shard)  # the directory went away: make it again
                self._ensure_dirs(shard)
                fd = os.open(tmp, flags, FILE_MODE)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                self._disable_direct(shard, exc)
                continue
            try:
                _write_all(fd, buffers, 0)
            except OSError as exc:
                os.close(fd)
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                os.unlink(tmp)
                self._disable_direct(shard, exc)
                continue
            return fd, direct

    def _discard_failed_write(self, key: BlockKey, final: str, tmp: str) -> None:
        """After a failed put: no temp file, and no older version of the key (base contract)."""
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        self._unlink_indexed(key, final)

    def _fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_cached_block(self, key: BlockKey, file_size: int, out: np.ndarray) -> _Outcome | None:
        """Read a block if the page cache holds all of it; else ask the kernel for it and return ``None``.

        The first pass over a batch reads with ``RWF_NOWAIT``, which fails instead of waiting for the
        disk. A block that is not cached gets ``posix_fadvise(WILLNEED)`` (the kernel starts reading
        it at once) and is read by :meth:`_read_block` after the thread's other blocks: a cold batch
        puts all its reads in flight together instead of ``io_threads`` at a time, and a warm block
        costs the same single ``preadv`` as before.
        """
        if not self._nowait or self._direct_reads:
            return self._read_block(key, file_size, out)
        group = key.group_id
        size = out.nbytes
        if file_size != self._raw_file_size[group] or size > READ_CHUNK:
            return self._read_block(key, file_size, out, nowait=True)
        # The warm raw block of at most one READ_CHUNK, inline (it is most reads): one open, one
        # ``preadv`` of [header page, block] from the page cache, the header compared whole and the
        # checksum taken. A block not all cached is put off as in _read_block; anything else, an
        # exception included, goes the full way (:meth:`_read_block`), which reads again and sorts
        # out misses, corrupt files and faults.
        page = self._scratch().read_page
        path = self._block_path(key)
        try:
            fd = os.open(path, _READ_FLAGS)
            try:
                got = self._pread(fd, path, [page, out.data], 0, nowait=True)
                if got is None:  # not all cached (or no RWF_NOWAIT here): read later, as _read_block does
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    return None
            finally:
                os.close(fd)
        except (OSError, CorruptBlock):
            return self._read_block(key, file_size, out, nowait=True)
        if got == PAGE + size:
            digest = start_raw_check(page, self._raw_headers[group].of(key))
            if digest is not None:
                digest.update(out.data)
                if finish_raw_check(page, digest):
                    return _Outcome(None, PAGE + size)
        return self._read_block(key, file_size, out, nowait=True)

    def _read_block(self, key: BlockKey, file_size: int, out: np.ndarray,
                    nowait: bool = False) -> _Outcome | None:
        """Read, check and deliver one block; ``nowait``: from the page cache alone, ``None`` if not there.

        A raw block (the common case) is read straight into ``out`` and checked against the header
        its key must carry and the checksum as it arrives (:meth:`_read_raw`): no decoding, no
        ``fstat`` (a FIFO, directory or device fails the read or the header, and only then is told
        apart from an I/O fault). Anything else is read again whole and takes the field-by-field
        path (:meth:`_check_block`), which also names what is wrong with a corrupt block.
        """
        group = key.group_id
        path = self._block_path(key)
        scratch = self._scratch()
        direct = self._direct_reads
        try:
            into_out = file_size == self._raw_file_size[group] and (not direct or _aligned(out))
            if into_out:
                target = out
            elif file_size - PAGE <= scratch.body.nbytes:
                target = scratch.body[:file_size - PAGE]
            else:
                raise CorruptBlock(f"indexed file size {file_size} exceeds any block of group {group}")
            fd = _open_block(path, os.O_DIRECT if direct else 0)
            try:
                if into_out:
                    expected = self._raw_headers[group].of(key)
                    verified = self._read_raw(fd, path, scratch.read_page, out, expected, nowait)
                    if verified:
                        return _Outcome(None, PAGE + out.nbytes)
                    if verified is None:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                        return None
                buffers = [scratch.read_page, target.data]
                got = (self._read_if_cached(fd, path, buffers, PAGE + target.nbytes) if nowait
                       else _read_all(fd, path, buffers))
                if got is None:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    return None
            finally:
                os.close(fd)
            return self._check_block(key, file_size, scratch, target, got, into_out, out)
        except FileNotFoundError:
            with self._lock:
                self._index_pop(key)
            return _Outcome("missing")
        except CorruptBlock as exc:
            self._corrupt_log.log("file tier %r: dropping corrupt block %s (%s): %s",
                                  self.name, key, path, exc)
            self._unlink_indexed(key, path)
            return _Outcome("corrupt")
        except OSError as exc:
            log.debug("file tier %r: reading %s failed: %s", self.name, key, exc)
            return _Outcome("io")

    def _read_raw(self, fd: int, path: str, page: memoryview, out: np.ndarray, expected: bytes,
                  nowait: bool) -> bool | None:
        """Read a raw block into ``out`` :data:`READ_CHUNK` bytes at a time, hashing each piece as it lands.

        ``True``: the header page is ``expected`` and the checksum matches, so ``out`` holds the block.
        ``False``: anything else (lz4, damage, a short file): the caller reads it again the long way.
        ``None`` (``nowait`` only): not all of it came from the page cache (or the filesystem refused
        ``RWF_NOWAIT``): the caller reads it later with plain reads.
        """
        view = out.data
        size = view.nbytes
        step = min(size, READ_CHUNK)
        first = view[:step]
        got = self._pread(fd, path, [page, first], 0, nowait)
        if got != PAGE + step:
            return None if nowait else False
        digest = start_raw_check(page, expected)
        if digest is None:
            return False
        digest.update(first)
        for offset in range(step, size, READ_CHUNK):
            piece = view[offset:offset + READ_CHUNK]
            if self._pread(fd, path, [piece], PAGE + offset, nowait) != piece.nbytes:
                return None if nowait else False
            digest.update(piece)
        return finish_raw_check(page, digest)

    def _pread(self, fd: int, path: str, buffers: list[memoryview], offset: int, nowait: bool) -> int | None:
        """One ``preadv``; with ``nowait`` from the page cache alone (``RWF_NOWAIT``), ``None`` if that
        needs the disk. A failure on what is not a regular file is :class:`CorruptBlock`."""
        try:
            return os.preadv(fd, buffers, offset, _RWF_NOWAIT) if nowait else os.preadv(fd, buffers, offset)
        except BlockingIOError:
            if not nowait:
                _refuse_irregular(fd, path)
                raise
            return None
        except OSError as exc:
            _refuse_irregular(fd, path)
            if not nowait or exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False  # the filesystem (or kernel) cannot: plain reads from now on
            return None

    def _check_block(self, key: BlockKey, file_size: int, scratch: _Scratch, target: np.ndarray, got: int,
                     into_out: bool, out: np.ndarray) -> _Outcome:
        """The field-by-field path of a read: decode the header, verify, decompress into ``out``; raise
        :class:`CorruptBlock` naming what is wrong."""
        if got < PAGE:
            raise CorruptBlock(f"truncated header page ({got} bytes)")
        header = decode_header(scratch.read_page, expected_key=key,
                               expected_layout=self._fingerprints[key.group_id],
                               expected_raw_len=self.layouts[key.group_id].nbytes,
                               expected_namespace=self.namespace_fp)
        if file_size != PAGE + _round_up(header.payload_len) or got < PAGE + header.payload_len:
            raise CorruptBlock(f"{got} bytes read of a {file_size}-byte file, "
                               f"payload is {header.payload_len} bytes")
        payload = target[:header.payload_len]
        if into_out and header.compressed:
            scratch.body[:header.payload_len] = payload
            payload = scratch.body[:header.payload_len]
        verify_payload(scratch.read_page, header, payload.data)
        if not into_out or header.compressed:  # else the verified bytes already are the block, in `out`
            decode_payload_into(header, payload.data, out, self._itemsize[key.group_id])
        return _Outcome(None, got)

    def _read_if_cached(self, fd: int, path: str, buffers: list[memoryview], nbytes: int) -> int | None:
        """Fill ``buffers`` (``nbytes``) from the page cache alone; ``None`` if that needs the disk."""
        got = self._pread(fd, path, buffers, 0, nowait=True)
        return got if got == nbytes else None

    def _delete_block(self, key: BlockKey) -> _Outcome:
        try:
            self._unlink_indexed(key, str(self.path_of(key)), raise_errors=True)
        except OSError as exc:
            log.debug("file tier %r: deleting %s failed: %s", self.name, key, exc)
            return _Outcome("io")
        return _Outcome(None)

    def _unlink_indexed(self, key: BlockKey, path: str, raise_errors: bool = False) -> None:
        """Unlink ``path`` and drop ``key`` from the index together; a file already gone is fine."""
        with self._lock:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                if raise_errors:
                    raise
            self._index_pop(key)

    # --- index -------------------------------------------------------------------------------------
    def _index_set(self, key: BlockKey, file_size: int) -> None:
        if self._index.get(key) is None:
            self._blocks_per_group[key.group_id] += 1
        self._index[key] = file_size

    def _index_pop(self, key: BlockKey) -> None:
        if self._index.pop(key, None) is not None:
            self._blocks_per_group[key.group_id] -= 1

    def _scan(self) -> None:
        """Rebuild the index from the tree: one pool task per shard directory removes its temp files and
        validates (name, size, header page) and indexes its block files; invalid ones are deleted."""
        start = time.perf_counter()
        shards: list[tuple[int, str, str]] = []
        removed_tmp = 0
        skipped_groups: list[str] = []
        with os.scandir(self.directory) as groups:
            for group_entry in groups:
                if _stale_tmp(group_entry):
                    os.unlink(group_entry.path)
                    removed_tmp += 1
                    continue
                group_id = self._parse_group(group_entry)
                if group_id is None:
                    continue
                if group_id not in self.layouts:
                    skipped_groups.append(group_entry.name)
                    continue
                with os.scandir(group_entry.path) as entries:
                    shards += [(group_id, e.name, e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        invalid = 0
        for shard, found in zip(shards, self._executor.map(self._scan_shard, shards), strict=True):
            self._made_dirs.add(shard[2])
            for key, size in found.blocks:
                self._index_set(key, size)
            invalid += found.invalid
            removed_tmp += found.removed_tmp
        if skipped_groups:
            log.warning("file tier %r: leaving %s under %s alone: not KV-cache groups of this tier",
                        self.name, ", ".join(sorted(skipped_groups)), self.directory)
        log.info("file tier %r: %d blocks indexed under %s (%d invalid and %d temporary files removed) "
                 "in %.2fs", self.name, len(self._index), self.directory, invalid, removed_tmp,
                 time.perf_counter() - start)

    def _scan_shard(self, shard: tuple[int, str, str]) -> _ShardScan:
        group_id, shard_name, shard_path = shard
        blocks: list[tuple[BlockKey, int]] = []
        invalid = removed_tmp = 0
        with os.scandir(shard_path) as entries:
            for entry in entries:
                if _stale_tmp(entry):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    removed_tmp += 1
                elif entry.name.endswith(TMP_SUFFIX):
                    continue  # another live process is writing it
                elif entry.name.endswith(BLOCK_SUFFIX):
                    key = self._parse_block_name(group_id, shard_name, entry.name)
                    info = entry.stat(follow_symlinks=False)
                    if (key is not None and stat.S_ISREG(info.st_mode)
                            and self._valid_file(key, entry.path, info.st_size)):
                        blocks.append((key, info.st_size))
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                        invalid += 1
        return _ShardScan(blocks, invalid, removed_tmp)

    @staticmethod
    def _parse_group(entry: os.DirEntry[str]) -> int | None:
        name = entry.name
        if not (name.startswith("g") and name[1:].isdigit() and entry.is_dir(follow_symlinks=False)):
            return None
        group_id = int(name[1:])
        return group_id if name == f"g{group_id}" else None

    @staticmethod
    def _parse_block_name(group_id: int, shard: str, name: str) -> BlockKey | None:
        hex_hash = name[:-len(BLOCK_SUFFIX)]
        try:
            block_hash = bytes.fromhex(hex_hash)
        except ValueError:
            return None
        if (block_hash.hex() != hex_hash or len(block_hash) > MAX_HASH_BYTES
                or (hex_hash[:2] or "00") != shard):
            return None
        return BlockKey(block_hash, group_id)

    def _valid_file(self, key: BlockKey, path: str, size: int) -> bool:
        """A plausible size (page multiple, at most a padded lz4 bound) and a header naming ``key``."""
        if size % PAGE or not 2 * PAGE <= size <= self._max_file_size[key.group_id]:
            return False
        try:
            fd = _open_block(path)
            try:
                _refuse_irregular(fd, path)  # the scan is not the hot path: check before reading
                page = os.pread(fd, PAGE, 0)
            finally:
                os.close(fd)
            header = decode_header(page, expected_key=key, expected_layout=self._fingerprints[key.group_id],
                                   expected_raw_len=self.layouts[key.group_id].nbytes,
                                   expected_namespace=self.namespace_fp)
        except (OSError, CorruptBlock) as exc:
            log.debug("file tier %r: removing %s: %s", self.name, path, exc)
            return False
        return size == PAGE + _round_up(header.payload_len)

    # --- bookkeeping ---------------------------------------------------------------------------------
    def _host_array(self, block: torch.Tensor, what: str) -> np.ndarray:
        if block.device.type != "cpu":
            raise LayoutMismatch(f"{what} for file tier {self.name!r} must be in host memory, "
                                 f"got {block.device}")
        return block.numpy()

    def _count_write(self, outcome: _Outcome) -> None:
        """Counters and health of one block written (reads are tallied per batch in :meth:`get`)."""
        if outcome.error is not None:
            self.counters.error(outcome.error)
            if outcome.error in ("enospc", "io"):
                self.report_health(False, f"writes failing ({outcome.error})")
        else:
            self.report_health(True)
            self.counters.blocks_written += 1
            self.counters.bytes_written += outcome.device_bytes

    def _log_over_capacity(self, keys: Mapping[BlockKey, int]) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        for gid in {key.group_id for key in keys}:
            used = self._blocks_per_group[gid] * self.layouts[gid].nbytes
            capacity = self.capacity_bytes.get(gid)
            if capacity is not None and used > capacity:
                log.debug("file tier %r: group %d holds %d bytes, over its capacity of %d (the cache evicts)",
                          self.name, gid, used, capacity)


_SYSCALLS = (os.open, os.preadv, os.close)


def _syscalls_unwrapped() -> bool:
    """Whether ``os.open``/``os.preadv``/``os.close`` are Python's own. The native reader makes the same
    calls from C, out of reach of a wrapper (a fault injector, a tracer): where one is installed, reads
    take the Python path so that it sees them."""
    return (os.open, os.preadv, os.close) == _SYSCALLS


def _open_block(path: str, flags: int = 0) -> int:
    """Open a block file for reading without following a link or blocking.

    ``O_NOFOLLOW`` refuses a symbolic link (:class:`CorruptBlock`: a miss, the entry removed) and
    ``O_NONBLOCK`` makes opening a FIFO (or a device) return at once instead of waiting for a writer
    forever. What is not a regular file then fails its read (``ESPIPE``, ``EISDIR``) or its header
    check: the hot path pays no ``fstat`` for a case that does not happen (:func:`_refuse_irregular`)."""
    try:
        return os.open(path, _READ_FLAGS | flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptBlock(f"{path} is a symbolic link, not a block file") from None
        raise


def _refuse_irregular(fd: int, path: str) -> None:
    """Raise :class:`CorruptBlock` if ``fd`` is not a regular file (called when a read fails)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise CorruptBlock(f"{path} is not a regular file (mode {stat.filemode(mode)})")


def _stale_tmp(entry: os.DirEntry[str]) -> bool:
    """A temp file left by a dead writer (or by an earlier life of this pid): safe to delete.

    Temp names are ``.<hash>.<pid>.<random>.tmp``; a live process's temp file is its write in flight.
    """
    if not entry.name.endswith(TMP_SUFFIX) or not entry.is_file(follow_symlinks=False):
        return False
    parts = entry.name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
