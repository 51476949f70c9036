"""Compile kvtier's CUDA sources with NVRTC itself, as CuPy does at run time, on a machine without a GPU.

nvcc accepting a source does not mean NVRTC does: NVRTC has no host headers (``<cstdint>``,
``<cstdio>``) and its own defines. kvtier compiles through CuPy's NVRTC (``cupy.RawModule``), so CI
compiles the shipped source text with :data:`kvtier.kernels.cuda.NVRTC_OPTIONS` plus what CuPy adds
(:func:`cupy_options`) through the NVRTC library of the ``nvidia-cuda-nvrtc-cu12`` wheel (the test
extra) or of the CUDA 13 wheel where that is installed. NVRTC's C API needs no driver and no
device, so ``ctypes`` is enough.

``python -m tests.kernels.nvrtc`` prints each kernel's registers and spills for every NVRTC found
and exits non-zero on a compile error, a spill or no NVRTC at all (``.ci/compile_kernels`` runs it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvtier.kernels import cuda

#: Where CI's NVRTC comes from, for the messages.
INSTALL_HINT = "pip install nvidia-cuda-nvrtc-cu12 (it is in kvtier's test extra)"
#: The architecture CI compiles for: the H100/H200 (Hopper).
ARCH = 90


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


@dataclass(frozen=True)
class NvrtcResult:
    """One NVRTC compilation: the library's answer, its log and the cubin or PTX it produced."""

    version: tuple[int, int]
    options: tuple[str, ...]
    ok: bool
    log: str
    output: bytes

    def resources(self) -> dict[str, KernelResources]:
        """Per-kernel registers and spills from a log compiled with ``-Xptxas=-v``."""
        found: dict[str, KernelResources] = {}
        name = ""
        stack = stores = loads = 0
        for line in self.log.splitlines():
            if match := re.search(r"Compiling entry function '(\w+)'", line):
                name = match.group(1)
            elif match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                    r"(\d+) bytes spill loads", line):
                stack, stores, loads = (int(group) for group in match.groups())
            elif (match := re.search(r"Used (\d+) registers", line)) and name:
                found[name] = KernelResources(int(match.group(1)), stores, loads, stack)
        return found


def find_libraries() -> list[Path]:
    """Every distinct NVRTC library here: ``$KVTIER_NVRTC``, pip's ``nvidia`` wheels, the CUDA toolkit."""
    candidates: list[Path] = []
    if os.environ.get("KVTIER_NVRTC"):
        candidates.append(Path(os.environ["KVTIER_NVRTC"]))
    for entry in sys.path:  # nvidia/cuda_nvrtc/lib (CUDA 12 wheels), nvidia/cu13/lib (CUDA 13 wheels)
        candidates += sorted((Path(entry or ".") / "nvidia").glob("**/libnvrtc.so*"))
    for toolkit in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if toolkit:
            candidates += sorted(Path(toolkit).glob("lib*/libnvrtc.so*"))
    found: dict[Path, Path] = {}
    for path in candidates:
        if path.is_file():
            found.setdefault(path.resolve(), path)
    if not found and ctypes.util.find_library("nvrtc"):  # a soname the dynamic loader resolves
        return [Path(str(ctypes.util.find_library("nvrtc")))]
    return list(found.values())


def _check(library: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        library.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{call} failed: {library.nvrtcGetErrorString(status).decode()}")


def _version(library: ctypes.CDLL) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library, library.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def library_version(library_path: Path) -> tuple[int, int]:
    """``(major, minor)`` of the NVRTC at ``library_path``."""
    return _version(ctypes.CDLL(str(library_path)))


def cupy_options(nvrtc_version: tuple[int, int], *, cubin: bool = True, arch: int = ARCH) -> tuple[str, ...]:
    """The options ``cupy.RawModule(code, options=NVRTC_OPTIONS)`` hands NVRTC for ``arch``.

    CuPy appends ``-ftz=true``, ``--device-as-default-execution-space`` (NVRTC 12 and later) and
    ``-arch=sm_XX`` when it loads a cubin or ``-arch=compute_XX`` when it JIT-loads PTX (older
    drivers). It also adds ``-I`` paths of its own and of the CUDA toolkit, which cannot matter:
    the shipped source includes nothing (checked in the tests).
    """
    options = cuda.NVRTC_OPTIONS + ("-ftz=true",)
    if nvrtc_version[0] >= 12:
        options += ("--device-as-default-execution-space",)
    return options + (f"-arch={'sm' if cubin else 'compute'}_{arch}",)


def ptxas_report_options(nvrtc_version: tuple[int, int]) -> tuple[str, ...]:
    """Options that make ptxas list each kernel's registers and spills in the program log.

    NVRTC 12.9 and later cache compiles, and a cached compile writes no ptxas report: on a machine
    where the same source was built before (CuPy's first transfer, an earlier test) the log came back
    empty. ``--no-cache`` makes every report-compile run ptxas.
    """
    options = ("-Xptxas=-v", "-Xptxas=-warn-spills")
    return options + (("--no-cache",) if nvrtc_version >= (12, 9) else ())


def compile_source(library_path: Path, source: str, options: tuple[str, ...],
                   name: str = "copy_blocks.cu") -> NvrtcResult:
    """Compile ``source`` with the NVRTC at ``library_path``; the cubin when ``-arch=sm_XX``, else PTX."""
    library = ctypes.CDLL(str(library_path))
    program = ctypes.c_void_p()
    _check(library, library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0,
                                               None, None),
           "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        status = library.nvrtcCompileProgram(program, len(encoded),
                                             (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        _check(library, library.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        _check(library, library.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
        output = b""
        if status == 0:
            kind = "CUBIN" if any(option.startswith("-arch=sm_") for option in options) else "PTX"
            get_size = getattr(library, f"nvrtcGet{kind}Size")
            _check(library, get_size(program, ctypes.byref(size)), f"nvrtcGet{kind}Size")
            data = ctypes.create_string_buffer(size.value)
            _check(library, getattr(library, f"nvrtcGet{kind}")(program, data), f"nvrtcGet{kind}")
            output = data.raw
        return NvrtcResult(_version(library), options, status == 0, log.value.decode(errors="replace"),
                           output)
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def main() -> int:
    """Compile every shipped source with every NVRTC found; report registers and spills."""
    libraries = find_libraries()
    if not libraries:
        print(f"NVRTC not found: cannot prove the run-time compile path; {INSTALL_HINT}", file=sys.stderr)
        return 1
    failed = False
    for library in libraries:
        for source in cuda.KERNEL_SOURCES:
            nvrtc_version = library_version(library)
            options = cupy_options(nvrtc_version) + ptxas_report_options(nvrtc_version)
            result = compile_source(library, cuda.kernel_source(source), options, source)
            label = f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} ({library.name}), {source}, sm_{ARCH}"
            if not result.ok:
                print(f"FAILED: {label}\n{result.log}", file=sys.stderr)
                failed = True
                continue
            for kernel, used in sorted(result.resources().items()):
                spills = used.spill_stores + used.spill_loads
                failed = failed or spills > 0
                print(f"{label}: {kernel} {used.registers} registers, "
                      f"{used.spill_stores} bytes spill stores, "
                      f"{used.spill_loads} bytes spill loads{'  <- SPILLS' if spills else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
