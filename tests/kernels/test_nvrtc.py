"""The run-time compile path without a GPU: NVRTC compiles the shipped source with kvtier's options.

Skips only where no NVRTC library is installed (it comes with the test extra); under CI it fails
instead, so CI never passes without having compiled through NVRTC.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.kernels import cuda
from tests.kernels import nvrtc

LIBRARIES = nvrtc.find_libraries()
KERNELS = ("kvtier_copy_blocks", "kvtier_pack_blocks", "kvtier_unpack_blocks")


@pytest.fixture(params=LIBRARIES or [None], ids=lambda path: path.name if path else "no-nvrtc")
def library(request: pytest.FixtureRequest) -> Path:
    if request.param is None:
        message = f"no NVRTC library found: {nvrtc.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    path: Path = request.param
    return path


def compile_shipped(library: Path, *, cubin: bool, extra: tuple[str, ...] = ()) -> nvrtc.NvrtcResult:
    options = nvrtc.cupy_options(nvrtc.library_version(library), cubin=cubin) + extra
    return nvrtc.compile_source(library, cuda.kernel_source(), options)


def test_load_module_hands_cupy_the_shipped_source_and_nvrtc_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the NVRTC tests compile is exactly what ``load_module`` gives CuPy (a recording stand-in)."""
    seen: dict[str, Any] = {}

    class RecordingRawModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            seen.update(code=code, options=options)

        def compile(self) -> None:
            seen["compiled"] = True

    class FakeCupy:
        RawModule = RecordingRawModule

        class cuda:  # noqa: N801 - mirrors cupy.cuda
            Device = staticmethod(lambda index: contextlib.nullcontext())

    monkeypatch.setattr(cuda, "require_cuda", lambda: FakeCupy)
    cuda.load_module.cache_clear()
    try:
        cuda.load_module(0)
    finally:
        cuda.load_module.cache_clear()
    assert seen == {"code": cuda.kernel_source(), "options": cuda.NVRTC_OPTIONS, "compiled": True}
    assert nvrtc.cupy_options((12, 9))[:len(cuda.NVRTC_OPTIONS)] == cuda.NVRTC_OPTIONS


@pytest.mark.parametrize("cubin", [True, False], ids=["cubin-sm_90", "ptx-compute_90"])
def test_nvrtc_compiles_the_shipped_source_as_cupy_does(library: Path, cubin: bool) -> None:
    result = compile_shipped(library, cubin=cubin)
    assert result.ok, f"NVRTC {result.version} refused copy_blocks.cu with {result.options}:\n{result.log}"
    assert "warning" not in result.log.lower(), result.log
    if cubin:
        assert result.output.startswith(b"\x7fELF")
        assert all(kernel.encode() in result.output for kernel in KERNELS)
    else:
        ptx = result.output.decode()
        assert f".target sm_{nvrtc.ARCH}" in ptx
        assert all(f".entry {kernel}(" in ptx for kernel in KERNELS)


def test_nvrtc_build_fits_the_launch_bounds_without_spills(library: Path) -> None:
    result = compile_shipped(library, cubin=True,
                             extra=nvrtc.ptxas_report_options(nvrtc.library_version(library)))
    assert result.ok, result.log
    used = result.resources()
    assert sorted(used) == sorted(KERNELS), result.log
    register_cap = 65536 // (cuda.THREADS * cuda.BLOCKS_PER_SM)  # __launch_bounds__(256, 4) on Hopper
    for kernel, resources in used.items():
        assert resources.spill_stores == resources.spill_loads == 0, f"{kernel} spills:\n{result.log}"
        assert resources.registers <= register_cap, f"{kernel}: {resources}"


def test_nvrtc_refuses_what_only_nvcc_accepts(library: Path) -> None:
    """The check has teeth: a host header nvcc finds is missing under NVRTC."""
    source = "#include <cstdio>\n" + cuda.kernel_source()
    result = nvrtc.compile_source(library, source, nvrtc.cupy_options(nvrtc.library_version(library)))
    assert not result.ok and "cstdio" in result.log
