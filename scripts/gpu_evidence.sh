#!/usr/bin/env bash
# GPU evidence for kvtier's Triton kernels: the CUDA kernel tests and the decode benchmark, end to
# end, in under 8 minutes, with every result written to $OUT (default ./gpu-evidence):
#   env.txt                  GPU, driver, Python / torch / triton versions
#   pytest-kernels.log       tests/test_kernels_triton.py on the GPU (realistic shapes)
#   junit-kernels.xml        the same as JUnit XML
#   bench-decode.txt         bench/decode_attention.py (paged vs contiguous, % of peak bandwidth,
#                            FlashInfer / vLLM columns where importable, launch-config sweep);
#                            its last line is the headline figure
#   decode_attention.png     time vs context length, paged vs contiguous
#   summary.txt              exit status of each step and the headline
#
# What the machine needs (nothing is downloaded unless pip can reach an index):
#   - an NVIDIA GPU with a working driver (nvidia-smi)
#   - Python >= 3.11 with a CUDA build of torch >= 2.4 and triton >= 3.0 (triton ships with
#     CUDA torch wheels) and numpy; pytest >= 8. Optional: matplotlib (the PNG), flashinfer and
#     vllm (comparison columns). Neither transformers nor grpc is needed here.
#   - the interpreter is $PYTHON if set, else ./.venv/bin/python if present, else python3.
#     Missing pytest / matplotlib are installed with pip when an index is reachable; otherwise the
#     step that needs them reports it (the bench still prints its table without matplotlib).
# Usage: OUT=/path/to/results scripts/gpu_evidence.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-evidence}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
# The repo root on the path: `kernels` imports without installing the package.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
log() { echo "$*" | tee -a "$SUMMARY"; }
started=$(date +%s)

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $PY ($("$PY" --version 2>&1))"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 || echo "nvidia-smi unavailable"
    "$PY" - <<'EOF' 2>&1
import importlib
for name in ("torch", "triton", "numpy", "pytest", "matplotlib", "flashinfer", "vllm"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__})")
import torch
print("torch.cuda:", torch.version.cuda, "available:", torch.cuda.is_available(),
      "device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
EOF
} >"$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "FATAL: $PY has no CUDA torch + triton (see env.txt); nothing to run"
    exit 2
fi
for pkg in pytest matplotlib; do
    if ! "$PY" -c "import $pkg" 2>/dev/null; then
        log "installing $pkg with pip (needs an index)"
        timeout 60 "$PY" -m pip install -q --retries 0 --timeout 5 "$pkg" >>"$OUT/env.txt" 2>&1 || log "could not install $pkg"
    fi
done

# 1. Kernel tests on the GPU. addopts cleared and conftest skipped: no dependency on pytest
#    plugins or on the service packages (grpc, transformers) the shared conftest may import.
tests_rc=1
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 270 "$PY" -m pytest tests/test_kernels_triton.py -o addopts="" -p no:cacheprovider --noconftest -q -rA \
        --junitxml="$OUT/junit-kernels.xml" 2>&1 | tee "$OUT/pytest-kernels.log"
    tests_rc=${PIPESTATUS[0]}
else
    echo "pytest not importable: kernel tests not run" | tee "$OUT/pytest-kernels.log"
fi
log "kernel tests: exit $tests_rc ($(tail -1 "$OUT/pytest-kernels.log"))"

# 2. Decode benchmark: full CUDA grid plus the launch-config sweep.
timeout 180 "$PY" bench/decode_attention.py --sweep-configs --plot "$OUT/decode_attention.png" 2>&1 \
    | tee "$OUT/bench-decode.txt"
bench_rc=${PIPESTATUS[0]}
log "decode bench: exit $bench_rc"
log "$(tail -1 "$OUT/bench-decode.txt")"
log "elapsed: $(($(date +%s) - started)) s; results in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
