#!/usr/bin/env bash
# `weftboard bench engine` on a GPU host: the same measures as on CPU (swap in place, pause to
# resume, against vLLM's own full reload; tokens, log-probs, deep digest; requests failed under
# load) on a bigger model, with a vLLM GPU build the host already has.
#
#   WEFTBOARD_ENGINE_PYTHON=/opt/vllm/bin/python subscriber/bench/engine_gpu.sh [OUT_DIR]
#
# WEFTBOARD_ENGINE_PYTHON: the Python of an environment with a CUDA build of vLLM 0.32, torch,
# numba, xxhash, structlog, safetensors and tokenizers (the worker extension imports this
# checkout through PYTHONPATH). The island side runs in the current Python with weftboard
# installed. The JSON result goes to OUT_DIR/bench_engine_gpu.json (default: $OUT or .).
set -euo pipefail
out="${1:-${OUT:-.}}"
mkdir -p "$out"
: "${WEFTBOARD_ENGINE_PYTHON:?set WEFTBOARD_ENGINE_PYTHON to a Python with a CUDA build of vLLM}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# hidden 4096, 8 layers: about 1.6 GB of bf16 weights (a 1B-class model's layers); 8 versions
weftboard bench engine --json --versions 8 --hidden 4096 --layers 8 --clients 4 \
    --engine-python "$WEFTBOARD_ENGINE_PYTHON" 2> "$out/bench_engine_gpu.log" | tail -1 > "$out/bench_engine_gpu.json"
python - "$out/bench_engine_gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("engine", "in_place", "write_mode", "versions", "tokens_match", "logprobs_match", "digest_match",
        "requests_failed", "stage_median_s", "in_place_median_s", "reload_median_s", "swap_speedup")
print({k: r[k] for k in keys})
PY
