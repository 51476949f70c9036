#!/usr/bin/env bash
# Every check of issue 5 that needs a GPU, in ONE call on the lent H200 (no network there):
# the environment and CuPy's own NVRTC build of the kernels (registers, local memory), every GPU
# test (kernels == torch fallback bit for bit, GPU tier, engine KV endpoint, copy engine), and
# benchmarks/bench_gpu.py (bandwidth table, the issue's targets, the measured crossover).
#
#   here, once (network, no GPU):  bash benchmarks/run_gpu_checks.sh --fetch
#       downloads into .whl/ (git-ignored) the few wheels kvtier needs that the GPU image lacks
#       (pydantic and its parts, lz4, hypothesis, redis-py for the config tests), for the image's Python 3.12 — about 4 MiB;
#   then on the GPU, one call:     device run, command "bash benchmarks/run_gpu_checks.sh",
#                                  carry [".whl"], timeout_s 450 (it normally takes 2-3 minutes)
#
# Writes everything to $OUT (or benchmarks/results/gpu_checks/ when OUT is unset), at most 9 files:
#   env.txt        GPU, driver, torch, CuPy, NVRTC versions; CuPy's build of each kernel
#   nvrtc.txt      tests/kernels/nvrtc.py over the NVRTC libraries of that machine (sm_90)
#   pytest.log, pytest.xml   the GPU tests (KVTIER_REQUIRE_GPU=1: a missing CUDA or CuPy fails, never skips)
#   pytest_vllm.log  the vLLM worker's CUDA page mover tests (kernel moves == torch moves, store/load)
#   bench_gpu.log, gpu_<device>.md, gpu_<device>.json   the benchmark (commit the .md and .json under
#                  benchmarks/results/ with the command above)
# Exits non-zero if any step failed; every step runs regardless, each under its own time limit.
# Never installs torch or CuPy: the GPU image has CUDA builds of both (torch 2.11+cu130, cupy-cuda13x);
# a CuPy wheel (>100 MiB) would not fit the 64 MiB that travels with a call.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=.whl

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$WHEELS"
  versions=$("$PYTHON" - <<'EOF'
import importlib.metadata as metadata
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "lz4",
         "hypothesis", "attrs", "sortedcontainers", "redis"]
print(" ".join(f"{name}=={metadata.version(name)}" for name in names))
EOF
  ) || { echo "install kvtier here first (pip install -e '.[test]'): its versions are the ones fetched" >&2; exit 1; }
  # shellcheck disable=SC2086 # one argument per requirement
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" $versions
  ls -l "$WHEELS"
  exit 0
fi

OUT=${OUT:-benchmarks/results/gpu_checks}
mkdir -p "$OUT"
failed=()
step() {  # step NAME SECONDS LOG COMMAND...: run COMMAND under a time limit, output to LOG and the console
  local name=$1 seconds=$2 log=$3; shift 3
  echo "=== $name (limit ${seconds}s)" | tee -a "$log"
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { failed+=("$name (exit $rc)"); echo "=== $name FAILED: exit $rc" | tee -a "$log"; }
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvtier-site "$WHEELS"/*.whl || failed+=("install carried wheels")
  export PYTHONPATH=/tmp/kvtier-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KVTIER_REQUIRE_GPU=1
if ! "$PYTHON" -c "import kvtier" 2>"$OUT/env.txt"; then
  cat "$OUT/env.txt"
  echo "kvtier does not import here (see above): run 'bash benchmarks/run_gpu_checks.sh --fetch' on the" \
       "developer machine and carry .whl with the call" | tee -a "$OUT/env.txt"
  exit 1
fi

ENV_PROBE=$(cat <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
import cupy
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| NVRTC", cupy.cuda.nvrtc.getVersion())
from kvtier.kernels import cuda
module = cuda.load_module(torch.cuda.current_device())  # CuPy's own NVRTC build, as at the first transfer
for name in ("kvtier_copy_blocks", "kvtier_pack_blocks", "kvtier_unpack_blocks"):
    attributes = module.get_function(name).attributes
    print(name, {key: attributes[key] for key in ("num_regs", "local_size_bytes", "max_threads_per_block")})
EOF
)
step "GPU" 30 "$OUT/env.txt" nvidia-smi \
  --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
step "torch, CuPy and CuPy's kernel build" 60 "$OUT/env.txt" "$PYTHON" -c "$ENV_PROBE"
step "NVRTC report" 40 "$OUT/nvrtc.txt" "$PYTHON" -m tests.kernels.nvrtc
step "GPU tests" 120 "$OUT/pytest.log" "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
  tests/kernels tests/tiers/test_gpu.py tests/test_config.py
step "vLLM worker GPU tests" 60 "$OUT/pytest_vllm.log" "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/connectors/test_vllm_unit.py
step "bench_gpu" 150 "$OUT/bench_gpu.log" "$PYTHON" benchmarks/bench_gpu.py --out "$OUT"

if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all GPU checks passed; results in $OUT"
