#!/usr/bin/env bash
# The GPU path's checks and timings in one call on a lent NVIDIA machine (issue 3, item 6).
#
# Why a script: a session is lent a GPU for about 15 minutes in all, a machine's start included,
# and that machine starts bare, with nothing fetched from outside. So this runs from the
# repository root as it travels there, with the Python packages the machine already holds
# (torch, triton, numba, numpy, xxhash, pytest, hypothesis, safetensors, protobuf): it installs
# nothing and imports weftboard.cuda and weftboard.proto straight from this checkout (the only
# parts the GPU path needs; the board, publisher and subscriber need structlog, redis and more).
#
# Steps, each under its own time limit so that one that hangs leaves the rest their time:
#   1. what the machine is (GPU, driver, package versions);
#   2. gpu_bench --tiny on the GPU: a functional run that compiles the Triton kernels for real
#      and the CPU coder's numba kernels (a cold cache compiles for a minute or more);
#   3. the full gpu_bench: the 7B-size bf16 set, its table and its bitwise checks, among them the
#      Triton decode+apply of the patch's huffman streams (triton_huffman) in GB/s beside copy_ of
#      the same tensors, checked against the new set and the CPU decoder's bytes, and the Triton
#      scan of the huffman encoder plus its host finish (triton_huffman_scan) beside copy_, checked
#      against the CPU encoder's bytes;
#   4. the tests that run only with a CUDA device: served projections on the GPU give the CPU's
#      bytes, and the compiled Triton kernels give the CPU path's on every element width and the
#      adversarial pairs, the huffman decoder included (test_triton_cuda.py; the interpreter tests
#      cannot see warps or vector loads).
# Everything printed is also written to $OUT/device_check.log ($OUT: the device tool's folder
# that comes back; /tmp/weftboard-device elsewhere). Exit status: 0 only if every step passed.
#
# With the device tool:   run(command="bash cuda/device_check.sh", timeout_s=600)  (the steps: at most 570 s)
# A dry run on a CPU (the same steps, Triton in its interpreter on tiny sets, no CUDA tests):
#   DEVICE_CHECK_CPU=1 bash cuda/device_check.sh
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/weftboard-device}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# weftboard.cuda and weftboard.proto from this checkout, under the names the code imports
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT  # the shim holds only links; nothing of it outlives the run
mkdir -p "$SHIM/weftboard"
ln -s "$ROOT/cuda" "$SHIM/weftboard/cuda"
ln -s "$ROOT/proto" "$SHIM/weftboard/proto"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

if [ "${DEVICE_CHECK_CPU:-0}" = 1 ]; then  # both runs on one small set in the interpreter
  export TRITON_INTERPRET=1
  FULL=(--device cpu --layers 1 --hidden 128 --intermediate 256 --vocab 300)
  TINY=("${FULL[@]}")
else
  FULL=()
  TINY=(--tiny)
fi

failed=()
step() {  # step NAME SECONDS COMMAND...: run one step, its output to the terminal and the log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (at most ${limit}s) ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s ===" | tee -a "$LOG"
  [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
  return "$rc"
}

machine() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "cpus: $(nproc)"
  "$PY" - <<'PYEOF'
import platform, numba, numpy, torch, triton, xxhash
import weftboard.cuda.bench.gpu_bench, weftboard.cuda.triton_kernels, weftboard.cuda.triton_huffman, weftboard.cuda
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
print("triton", triton.__version__, "numba", numba.__version__, "numpy", numpy.__version__, "xxhash", xxhash.VERSION)
print("weftboard.cuda from", list(weftboard.cuda.__path__))
PYEOF
}
export PY
export -f machine
step "machine" 20 bash -c machine

if step "gpu_bench --tiny" 180 "$PY" -m weftboard.cuda.bench.gpu_bench "${TINY[@]}"; then
  step "gpu_bench, the full set (7B-size bf16 on a GPU)" 270 "$PY" -m weftboard.cuda.bench.gpu_bench ${FULL[@]+"${FULL[@]}"}
else
  echo "skipping the full gpu_bench: the tiny run failed" | tee -a "$LOG"
fi

# --noconftest: tests/conftest.py starts Redis and SeaweedFS fixtures and imports the board;
# the tests named here need neither. -W: the ini's pytest-asyncio keys are unknown there.
step "CUDA tests" 90 "$PY" -m pytest -q -p no:cacheprovider --noconftest -W ignore::pytest.PytestConfigWarning \
  "$ROOT/tests/test_formats.py" "$ROOT/tests/test_triton_cuda.py" -k cuda

if [ "${#failed[@]}" = 0 ]; then
  echo "device_check: every step passed; log in $LOG" | tee -a "$LOG"
  exit 0
fi
printf 'device_check: FAILED: %s\n' "${failed[@]}" | tee -a "$LOG"
exit 1
