"""Host-side kernels: row copies with streaming stores, built at run time with the system C compiler.

``streamcopy.c`` (beside this file) is compiled once per source and machine into the user's cache
(``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``) and loaded
with ctypes, which releases the GIL for each call; Triton builds its launchers the same way. Where
there is no compiler, the build fails or ``KVTIER_NATIVE=0`` is set, :func:`stream_copy` and
:func:`stream_scatter` answer ``False`` and the caller copies with numpy: the helper makes copies
faster, never different (docs/architecture.md#kernels).
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

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("streamcopy.c")
#: the compiler's flags: no -march, so a cache shared by different machines of one architecture works
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
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
    """Compile ``streamcopy.c`` with ``cc`` into ``out_dir`` (unless built already) and return the library.

    The name carries a hash of the source, compiler, flags and machine; the library is written under
    a temporary name and renamed, so processes building at once never load a half-written file.
    Raises :class:`OSError` or :class:`subprocess.CalledProcessError` (with the compiler's output).
    """
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(CFLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = out_dir / f"streamcopy-{tag}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".streamcopy-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    """The built helper, building it on the first call of the process; None where it cannot be had."""
    global _lib, _tried, unavailable_reason
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
            lib = ctypes.CDLL(str(build(cc, cache_dir())))
            lib.kvt_streaming.restype = ctypes.c_int
            lib.kvt_stream_strided.restype = None
            address, i64 = ctypes.c_size_t, ctypes.c_int64
            lib.kvt_stream_strided.argtypes = [address, i64, address, i64, i64, i64]
            lib.kvt_stream_scatter.restype = None
            lib.kvt_stream_scatter.argtypes = [ctypes.c_void_p, address, i64, i64, i64]
            if not lib.kvt_streaming():
                raise RuntimeError(f"no streaming stores on {platform.machine()}")
            _lib = lib
        except subprocess.CalledProcessError as exc:
            unavailable_reason = f"building {SOURCE.name} failed: {exc.stderr.strip()[-500:]}"
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            unavailable_reason = str(exc)
        if unavailable_reason is not None:
            log.info("kvtier: streaming-store copies unavailable (%s); CPU-tier stores use memcpy",
                     unavailable_reason)
        _tried = True
        return _lib


def available() -> bool:
    """Whether the streaming-store helper is built and loaded (building it on the first call)."""
    return _load() is not None


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
    if lib is None or dst.shape != src.shape or dst.dtype != src.dtype or not dst.flags.writeable:
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
    if (lib is None or src.ndim != 2 or src.shape[0] != len(slots) or src.shape[1:] != slab.shape[1:]
            or src.dtype != slab.dtype or not slab.flags.writeable or not slots):
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
