"""Host-side kernels, built at run time with the system C compiler: streaming-store row copies
(``streamcopy.c``), a file tier's warm reads a batch per call (``fileread.c``) and a Redis tier's
raw-block GETs and SETs a run per call (``redisio.c``).

The sources beside this file are compiled once per source and machine into one library in the
user's cache (``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``) and
loaded with ctypes, which releases the GIL for each call; Triton builds its launchers the same way.
Where there is no compiler, the build fails or ``KVTIER_NATIVE=0`` is set, :func:`stream_copy`,
:func:`stream_scatter`, :func:`read_warm`, :func:`redis_get` and :func:`redis_set` answer
``False``/``None`` and the caller does the work in Python: the helpers make things faster, never
different (docs/architecture.md#kernels).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("streamcopy.c", "fileread.c", "redisio.c"))
#: headers the sources include: part of the library's name, so a changed header rebuilds it
HEADERS = (Path(__file__).with_name("xxh3_fns.h"),)
#: the compiler's flags: no -march, so a cache shared by different machines of one architecture works
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-pthread")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_streaming = False  # the library's copies use streaming stores (x86-64)
_xxh3: ctypes.Array[ctypes.c_void_p] | None = None  # xxhash's XXH3 functions, for read_warm
_tried = False
#: why the helper is not in use (None while it is, or before the first try)
unavailable_reason: str | None = None


def cache_dir() -> Path:
    """Where built helpers are kept: ``$KVTIER_CACHE_DIR``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier"


def compiler() -> str | None:
    """The C compiler: ``$CC`` if set, else the first of ``cc``, ``gcc``, ``clang`` on the PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def build(cc: str, out_dir: Path) -> Path:
    """Compile the sources with ``cc`` into one library in ``out_dir`` (unless built already); return it.

    The name carries a hash of the sources and their header, compiler, flags and machine; the library
    is written under a temporary name and renamed, so processes building at once never load a
    half-written file.
    Raises :class:`OSError` or :class:`subprocess.CalledProcessError` (with the compiler's output).
    """
    parts = [*(path.read_bytes() for path in (*SOURCES, *HEADERS)), cc.encode(), " ".join(CFLAGS).encode(),
             platform.machine().encode()]
    tag = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = out_dir / f"kvtier-host-{tag}.so"
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _refuse_shared(out_dir)
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".kvtier-host-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _refuse_shared(directory: Path) -> None:
    """Raise :class:`PermissionError` unless ``directory`` is ours and no one else may write in it: a
    library loaded from it runs as this process, so another user must not be able to plant one."""
    st = os.stat(directory)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} is writable by others or not owned by this user "
                              f"(mode {st.st_mode & 0o777:o}, owner {st.st_uid}); not loading code from it")


def _load_built(cc: str) -> ctypes.CDLL:
    """:func:`build` into :func:`cache_dir` and load; where that directory cannot be used (read-only,
    someone else's), build into a private temporary directory, load, and remove it (the next process
    builds again)."""
    try:
        return ctypes.CDLL(str(build(cc, cache_dir())))
    except OSError as exc:
        log.info("kvtier: cannot keep the host helpers in %s (%s); building them for this process",
                 cache_dir(), exc)
    private = tempfile.mkdtemp(prefix="kvtier-host-")  # 0700, a fresh name
    try:
        return ctypes.CDLL(str(build(cc, Path(private))))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _load() -> ctypes.CDLL | None:
    """The built helper, building it on the first call of the process; None where it cannot be had."""
    global _lib, _streaming, _xxh3, _tried, unavailable_reason
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("KVTIER_NATIVE", "1") == "0":
                raise RuntimeError("KVTIER_NATIVE=0")
            cc = compiler()
            if cc is None:
                raise RuntimeError("no C compiler (set CC, or install cc, gcc or clang)")
            lib = _load_built(cc)
            lib.kvt_streaming.restype = ctypes.c_int
            lib.kvt_stream_strided.restype = None
            address, i64 = ctypes.c_size_t, ctypes.c_int64
            lib.kvt_stream_strided.argtypes = [address, i64, address, i64, i64, i64]
            lib.kvt_stream_scatter.restype = None
            lib.kvt_stream_scatter.argtypes = [ctypes.c_void_p, address, i64, i64, i64]
            lib.kvt_read_warm.restype = i64
            pointer = ctypes.c_void_p
            text = ctypes.c_char_p
            lib.kvt_read_warm.argtypes = [i64, text, text, i64, text, pointer, i64, i64, text, i64, i64, i64,
                                          pointer, pointer]
            lib.kvt_pool_start.restype = pointer
            lib.kvt_pool_start.argtypes = [i64, i64]
            lib.kvt_pool_submit.restype = i64
            lib.kvt_pool_submit.argtypes = [pointer, i64, text, text, i64, text, pointer, i64, i64, text, i64,
                                            i64, i64, pointer, pointer, ctypes.c_uint64]
            lib.kvt_pool_stop.restype = None
            lib.kvt_pool_stop.argtypes = [pointer]
            lib.kvt_redis_get.restype = i64
            lib.kvt_redis_get.argtypes = [i64, i64, text, pointer, pointer, pointer, i64, text, i64, i64, i64,
                                          pointer, pointer, i64, pointer, pointer]
            lib.kvt_redis_set.restype = i64
            lib.kvt_redis_set.argtypes = [i64, i64, text, pointer, pointer, pointer, text, i64, i64, text,
                                          i64, i64, i64, pointer, pointer, i64, pointer, pointer]
            _lib, _streaming, _xxh3 = lib, bool(lib.kvt_streaming()), _xxh3_functions()
        except subprocess.CalledProcessError as exc:
            unavailable_reason = f"building the host helpers failed: {exc.stderr.strip()[-500:]}"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            unavailable_reason = str(exc)
        if unavailable_reason is not None:
            log.info("kvtier: host helpers unavailable (%s); CPU-tier stores use memcpy and file-tier "
                     "reads Python", unavailable_reason)
        _tried = True
        return _lib


def available() -> bool:
    """Whether streaming-store copies can run: the library built and loaded (building it on the first
    call), on a CPU with streaming stores (x86-64; elsewhere the library's copies are plain)."""
    return _load() is not None and _streaming


def _rows_of(array: np.ndarray) -> tuple[int, int, int] | None:
    """(address, row stride, row bytes) of a 2-D array whose rows are each contiguous, else None."""
    if array.ndim != 2 or array.strides[1] != array.itemsize:
        return None
    return array.__array_interface__["data"][0], array.strides[0], array.shape[1] * array.itemsize


def stream_copy(dst: np.ndarray, src: np.ndarray) -> bool:
    """Copy ``src`` into ``dst`` (2-D, same shape and dtype, rows contiguous) with streaming stores.

    ``False`` (nothing copied) where the helper is unavailable or the arrays do not qualify: the
    caller then copies with ``np.copyto``.
    """
    lib = _lib if _tried else _load()
    if (lib is None or not _streaming or dst.shape != src.shape or dst.dtype != src.dtype
            or not dst.flags.writeable):
        return False
    d, s = _rows_of(dst), _rows_of(src)
    if d is None or s is None:
        return False
    lib.kvt_stream_strided(d[0], d[1], s[0], s[1], dst.shape[0], d[2])
    return True


def stream_scatter(slab: np.ndarray, slots: list[int], src: np.ndarray) -> bool:
    """``slab[slots] = src`` with streaming stores (``slab`` 2-D with contiguous rows, ``src`` one row
    per slot); ``False`` (nothing copied) where that cannot be done so. Slots are bounds-checked."""
    lib = _lib if _tried else _load()
    if (lib is None or not _streaming or not slots or src.ndim != 2 or src.shape[0] != len(slots)
            or src.shape[1:] != slab.shape[1:] or src.dtype != slab.dtype or not slab.flags.writeable):
        return False
    d, s = _rows_of(slab), _rows_of(src)
    if d is None or s is None:
        return False
    index = np.asarray(slots, dtype=np.int64)
    if int(index.min()) < 0 or int(index.max()) >= slab.shape[0]:
        raise IndexError(f"slots {slots} out of range for a slab of {slab.shape[0]} rows")
    addresses = (index * d[1] + d[0]).astype(np.uint64)
    lib.kvt_stream_scatter(addresses.ctypes.data, s[0], s[1], len(slots), d[2])
    return True


def _xxh3_functions() -> ctypes.Array[ctypes.c_void_p] | None:
    """The XXH3 streaming functions of the loaded ``xxhash`` package (its extension exports them), for
    :func:`read_warm`'s checksums; None if this build of the package does not export them."""
    try:
        import xxhash._xxhash as extension

        lib = ctypes.CDLL(extension.__file__)
        # the update that picks SSE2/AVX2/AVX-512 by CPU at run time, as the package's own xxh3_64
        # objects do (its plain XXH3_64bits_update is the build's baseline: SSE2)
        update = next((name for name in ("XXH3_64bits_update_dispatch",) if hasattr(lib, name)),
                      "XXH3_64bits_update")
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", update, "XXH3_64bits_digest")
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
        return (ctypes.c_void_p * len(names))(*addresses)
    except (ImportError, OSError, AttributeError) as exc:
        log.info("kvtier: xxhash's XXH3 functions not found (%s); file-tier reads in Python", exc)
        return None


def reads_available() -> bool:
    """Whether :func:`read_warm` can run (the library built, xxhash's XXH3 functions found)."""
    return _load() is not None and _xxh3 is not None


def read_warm(prefix: bytes, hashes: bytes, hash_len: int, suffix: bytes, outs: np.ndarray, size: int,
              chunk: int, expected: bytes, header_size: int, checksum_offset: int, page_size: int,
              ) -> np.ndarray | None:
    """Read each block file (a header page, then ``size`` bytes into address ``outs[i]``, ``chunk``
    bytes per read, each hashed as it lands) from the page cache alone and check it: an ``int32``
    status per block (``fileread.c``: 0 read and verified, 1 not cached and asked for, 2 read it the
    long way). None: the helper is unavailable.

    Block ``i``'s file is ``prefix``, the first byte of its hash (``hashes[i * hash_len:][:hash_len]``)
    in hex, ``/``, the hash in hex, ``suffix``: the file tier's layout. ``outs`` (``uint64``) must
    address writable buffers of ``size`` bytes each; ``expected`` holds the headers the blocks must
    carry, ``header_size`` bytes each, their checksum fields zeroed.
    """
    lib = _lib if _tried else _load()
    if lib is None or _xxh3 is None:
        return None
    n = check_batch(hashes, hash_len, outs, expected, header_size, chunk)
    status = np.empty(n, dtype=np.int32)
    if lib.kvt_read_warm(n, prefix, hashes, hash_len, suffix, outs.ctypes.data, size, chunk, expected,
                         header_size, checksum_offset, page_size, status.ctypes.data, _xxh3) < 0:
        raise MemoryError("read_warm: no memory for a header page and a hash state")
    return status


def check_batch(hashes: bytes, hash_len: int, outs: np.ndarray, expected: bytes, header_size: int,
                chunk: int) -> int:
    """The number of blocks of a :func:`read_warm` batch; ValueError naming what does not agree."""
    n = len(outs)
    if (hash_len < 0 or len(hashes) != n * hash_len or outs.dtype != np.uint64 or outs.shape != (n,)
            or len(expected) != n * header_size or chunk <= 0):
        raise ValueError(f"read_warm: {len(hashes)} hash bytes of {hash_len} each, outs {outs.dtype}"
                         f"{outs.shape}, {len(expected)} header bytes of {header_size} each, chunk {chunk}")
    return n


#: ``redisio.c``'s statuses: a GET's value read and verified, absent, corrupt (header right, checksum
#: wrong); a request to send again the long way (a value it does not decide); not done (not sent, or
#: the connection failed); refused (the call's first error reply, whose text is returned).
REDIS_OK, REDIS_ABSENT, REDIS_CORRUPT, REDIS_AGAIN, REDIS_NOT_DONE, REDIS_REFUSED = range(6)
#: ``redisio.c``'s failures (a negative return): the connection is no longer usable.
REDIS_FAILURES = {-1: "timeout", -2: "closed", -3: "protocol", -4: "no memory"}
_MAX_HEADER = 512
_REFUSAL_ROOM = 512


def redis_available() -> bool:
    """Whether :func:`redis_get` and :func:`redis_set` can run (the library built, XXH3 found)."""
    return reads_available()


def _stop_flag(stop: np.ndarray) -> int:
    if stop.dtype != np.int32 or stop.shape != (1,):
        raise ValueError(f"stop must be one int32, got {stop.dtype}{stop.shape}")
    return int(stop.ctypes.data)


def _redis_batch(keys: list[bytes], addresses: np.ndarray, sizes: np.ndarray, expected: bytes,
                 header_size: int) -> tuple[bytes, np.ndarray, int]:
    n = len(keys)
    if (addresses.dtype != np.uint64 or addresses.shape != (n,) or sizes.dtype != np.int64
            or sizes.shape != (n,) or len(expected) != n * header_size or not 0 < header_size <= _MAX_HEADER):
        raise ValueError(f"redis batch: {n} keys, addresses {addresses.dtype}{addresses.shape}, sizes "
                         f"{sizes.dtype}{sizes.shape}, {len(expected)} header bytes of {header_size} each")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(key) for key in keys], out=offsets[1:])
    return b"".join(keys), offsets, n


def redis_get(fd: int, keys: list[bytes], outs: np.ndarray, sizes: np.ndarray, chunk: int, expected: bytes,
              header_size: int, checksum_offset: int, depth: int, stop: np.ndarray,
              ) -> tuple[int, np.ndarray, str] | None:
    """GET ``keys`` on the connected socket ``fd`` (blocking, kernel timeouts, nothing buffered), value
    ``i`` (``header ‖ sizes[i]`` raw bytes) into address ``outs[i]``, its header compared with
    ``expected[i * header_size:]`` (checksum field zeroed), ``depth`` requests in flight, the payload
    received and hashed ``chunk`` bytes at a time; no request is sent once ``stop`` (one ``int32``, set
    by another thread) is non-zero. Returns (0, 1 after an error reply or a negative
    failure; an ``int32`` status per key, ``REDIS_*``; the error reply's text or ""); None where the
    helper is unavailable."""
    lib = _lib if _tried else _load()
    if lib is None or _xxh3 is None:
        return None
    blob, offsets, n = _redis_batch(keys, outs, sizes, expected, header_size)
    return _redis_call(lib.kvt_redis_get, n, stop, fd, n, blob, offsets.ctypes.data, outs.ctypes.data,
                       sizes.ctypes.data, chunk, expected, header_size, checksum_offset, depth)


def redis_set(fd: int, keys: list[bytes], srcs: np.ndarray, sizes: np.ndarray, expected: bytes,
              header_size: int, checksum_offset: int, tail: bytes, nargs: int, depth: int, stop: np.ndarray,
              ) -> tuple[int, np.ndarray, str] | None:
    """SET each of ``keys`` to ``header ‖ payload`` on ``fd``: the payload is ``sizes[i]`` bytes at address
    ``srcs[i]``, the header ``expected[i * header_size:]`` with the checksum computed here; ``tail``
    (e.g. ``PX`` and its value, ``nargs`` 5) follows each value. Returns as :func:`redis_get`."""
    lib = _lib if _tried else _load()
    if lib is None or _xxh3 is None:
        return None
    blob, offsets, n = _redis_batch(keys, srcs, sizes, expected, header_size)
    return _redis_call(lib.kvt_redis_set, n, stop, fd, n, blob, offsets.ctypes.data, srcs.ctypes.data,
                       sizes.ctypes.data, expected, header_size, checksum_offset, tail, len(tail), nargs,
                       depth)


def _redis_call(entry: Any, n: int, stop: np.ndarray, *args: object) -> tuple[int, np.ndarray, str]:
    """Call ``entry`` with ``args`` and the arguments every redisio.c call ends with: (its return, the
    statuses, the error reply's text)."""
    status = np.empty(n, dtype=np.int32)
    refusal = ctypes.create_string_buffer(_REFUSAL_ROOM)
    rc = entry(*args, status.ctypes.data, ctypes.addressof(refusal), _REFUSAL_ROOM, _stop_flag(stop), _xxh3)
    return int(rc), status, refusal.value.decode("utf-8", "replace")
