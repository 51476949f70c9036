"""What the machine offers: available memory honours a container's cgroup limit."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.hostinfo import _cgroup_headroom, available_memory, usable_cpus


def test_cgroup_headroom_reads_v2_then_v1(tmp_path: Path) -> None:
    assert _cgroup_headroom(tmp_path) is None  # no cgroup files: no limit known
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "no limit"
    (tmp_path / "memory/memory.usage_in_bytes").write_text("4096\n")
    assert _cgroup_headroom(tmp_path) is None
    (tmp_path / "memory/memory.limit_in_bytes").write_text("1073741824\n")
    assert _cgroup_headroom(tmp_path) == (1 << 30) - 4096
    (tmp_path / "memory.max").write_text("max\n")  # v2 wins where it is mounted
    (tmp_path / "memory.current").write_text("100\n")
    assert _cgroup_headroom(tmp_path) is None
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("1500\n")  # over the limit: nothing left, not negative
    assert _cgroup_headroom(tmp_path) == 0


def test_available_memory_is_a_positive_byte_count_here() -> None:
    available = available_memory()
    assert available is not None and 0 < available < 1 << 50  # this suite runs on Linux


def test_usable_cpus_is_the_affinity_mask_at_least_one() -> None:
    cpus = usable_cpus()
    assert 1 <= cpus <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert cpus == len(os.sched_getaffinity(0))
