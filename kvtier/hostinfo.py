"""What this machine offers a cache: CPUs, available memory, free disk, whether CUDA runs — without torch.

``kvtier check`` compares capacities with these and says "pinned" only where CUDA is present; it must
not import torch (seconds) to find out, so CUDA is probed the way torch would find it: a CUDA build of
torch installed, and a driver that reports at least one device.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or what this process's cgroup still allows
    when that is less (a container sees the host's meminfo, and is killed at its own limit); None
    where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    allowed = _cgroup_headroom()
    if allowed is not None and (available is None or allowed < available):
        return allowed
    return available


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of this process's cgroup less its usage (v2, then v1); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit" (~2^63)
            return None
        return max(0, int(limit) - usage)
    return None


def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (where a new directory would go)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def free_disk(path: str | Path) -> tuple[Path, int]:
    """(the existing directory measured, bytes free to this user) on the filesystem ``path`` is or would
    be on."""
    where = existing_ancestor(path)
    return where, shutil.disk_usage(where).free


def bytes_under(directory: str | Path) -> int:
    """Bytes of the regular files below ``directory`` (0 if it does not exist); symbolic links are not
    followed."""
    total = 0
    stack = [str(directory)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


_TORCH_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(['\"])(.+?)\1", re.MULTILINE)


def cuda_present() -> bool:
    """Whether ``torch.cuda.is_available()`` would be true, answered without importing torch if it is not
    loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:  # torch/version.py says `cuda = '12.8'` in a CUDA build, `cuda = None` in a CPU one
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return False
    if not _TORCH_CUDA.search(text):
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
