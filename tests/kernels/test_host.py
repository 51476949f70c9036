"""The streaming-store copy helper (kvtier/kernels/streamcopy.c, built at run time): exact copies,
refusals that copy nothing, and the numpy fallback where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kernels import host

pytestmark = pytest.mark.skipif(host.compiler() is None, reason="no C compiler on this machine")

ROWS = 9


def test_the_helper_builds_and_loads_here() -> None:
    assert host.available(), host.unavailable_reason
    assert host.unavailable_reason is None
    assert list(host.cache_dir().glob("kvtier-host-*.so"))


@given(rows=st.integers(0, ROWS), width=st.integers(0, 700), dst_skew=st.integers(0, 63),
       src_skew=st.integers(0, 63), dst_pad=st.integers(0, 70), reverse=st.booleans())
@settings(max_examples=150, deadline=None)
def test_stream_copy_equals_np_copyto(rows: int, width: int, dst_skew: int, src_skew: int, dst_pad: int,
                                      reverse: bool) -> None:
    """Any row width (under and over a 64-byte line), any alignment of either side, rows further apart
    than their width, rows walked backwards: the bytes np.copyto writes, and no byte outside the rows."""
    rng = np.random.default_rng(rows * 1000 + width)
    stride = width + dst_pad
    dst_mem = rng.integers(0, 256, dst_skew + ROWS * stride + 1, dtype=np.uint8)
    src_mem = rng.integers(0, 256, src_skew + ROWS * width + 1, dtype=np.uint8)
    dst = np.lib.stride_tricks.as_strided(dst_mem[dst_skew:], (rows, width), (stride, 1))
    src = src_mem[src_skew:src_skew + rows * width].reshape(rows, width)
    if reverse:
        dst = dst[::-1]
    want = dst_mem.copy()
    want_view = np.lib.stride_tricks.as_strided(want[dst_skew:], (rows, width), (stride, 1))
    np.copyto(want_view[::-1] if reverse else want_view, src)
    assert host.stream_copy(dst, src)
    assert np.array_equal(dst_mem, want)


@given(slots=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
       width=st.integers(1, 300))
@settings(max_examples=80, deadline=None)
def test_stream_scatter_equals_fancy_assignment(slots: list[int], width: int) -> None:
    rng = np.random.default_rng(len(slots) * 31 + width)
    slab = rng.integers(0, 256, (ROWS, width), dtype=np.uint8)
    src = rng.integers(0, 256, (len(slots), width), dtype=np.uint8)
    want = slab.copy()
    want[np.asarray(slots)] = src
    assert host.stream_scatter(slab, slots, src)
    assert np.array_equal(slab, want)


def test_overlapping_rows_copy_as_memmove() -> None:
    mem = np.arange(256, dtype=np.uint8)
    want = mem.copy()
    want[3:203] = mem[0:200].copy()
    assert host.stream_copy(mem[3:203].reshape(1, 200), mem[0:200].reshape(1, 200))
    assert np.array_equal(mem, want)


def test_what_it_cannot_take_is_refused_and_left_untouched() -> None:
    slab = np.zeros((4, 64), np.uint8)
    assert not host.stream_copy(slab[:, ::2], np.ones((4, 32), np.uint8))  # rows not contiguous
    assert not host.stream_copy(slab, np.ones((4, 32), np.uint16))  # another dtype
    assert not host.stream_copy(slab, np.ones((3, 64), np.uint8))  # another shape
    frozen = np.zeros((4, 64), np.uint8)
    frozen.flags.writeable = False
    assert not host.stream_copy(frozen, np.ones((4, 64), np.uint8))
    assert not host.stream_scatter(slab, [0, 1], np.ones((3, 64), np.uint8))  # a row per slot
    assert not slab.any() and not frozen.any()
    with pytest.raises(IndexError, match="out of range for a slab of 4 rows"):
        host.stream_scatter(slab, [1, 4], np.ones((2, 64), np.uint8))
    assert not slab.any()


def test_a_build_is_reused_and_written_whole(tmp_path: Path) -> None:
    cc = host.compiler()
    assert cc is not None
    first = host.build(cc, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert host.build(cc, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


_FALLBACK = """
import asyncio, logging, torch
from kvtier import BlockKey
logging.basicConfig(level=logging.INFO, format="%(message)s")
from kvtier.kernels import host
from kvtier.layout import BlockLayout
from kvtier.tiers.cpu import CpuTier
layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
tier = CpuTier("t", {0: layout}, {0: 8 * layout.nbytes}, pinned=False, streaming_stores=True)
assert not tier.copier.streaming
data = torch.randint(0, 256, (8, layout.nbytes), dtype=torch.uint8)
keys = [BlockKey(bytes([i]) * 16, 0) for i in range(8)]
assert asyncio.run(tier.put(keys, data)) == [True] * 8
out = torch.zeros_like(data)
assert asyncio.run(tier.get(keys, out)) == [True] * 8
assert torch.equal(out, data)
import tempfile
from kvtier.tiers.file import FileTier
with tempfile.TemporaryDirectory() as root:
    files = FileTier("f", {0: layout}, {0: 1 << 24}, root=root, namespace="n")
    assert not files._native_reads
    assert asyncio.run(files.put(keys, data)) == [True] * 8
    out = torch.zeros_like(data)
    assert asyncio.run(files.get(keys, out)) == [True] * 8
    assert torch.equal(out, data)
    asyncio.run(files.close())
print("reason:", host.unavailable_reason)
"""


@pytest.mark.parametrize("env, reason", [({"CC": "false"}, "building the host helpers failed"),
                                         ({"KVTIER_NATIVE": "0"}, "KVTIER_NATIVE=0")])
def test_without_the_helper_the_cpu_tier_copies_with_numpy(tmp_path: Path, env: dict[str, str],
                                                             reason: str) -> None:
    """A compiler that fails (or the helpers switched off) leaves working CPU and file tiers; the log
    says why, once."""
    run = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVTIER_CACHE_DIR": str(tmp_path), **env})
    assert run.returncode == 0, run.stderr
    assert f"reason: {reason}" in run.stdout
    assert run.stderr.count("host helpers unavailable") == 1
    assert not list(tmp_path.glob("*.so"))


def test_a_cache_directory_others_may_write_is_not_loaded_from(tmp_path: Path) -> None:
    """A library there could have been planted by another user: the helpers are built for this process
    in a private directory instead (and work), and nothing is written to the shared one."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        host.build(host.compiler() or "cc", shared)
    script = "from kvtier.kernels import host; print(host.available(), host.reads_available())"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVTIER_CACHE_DIR": str(shared)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True"]
    assert list(shared.iterdir()) == []
