#!/usr/bin/env bash
# GPU evidence for the whole kvtier stack, in one command and under 10 minutes (a global deadline:
# each step gets at most its cap and what is left of the budget), every result written to $OUT
# (default ./gpu-evidence):
#   env.txt                GPU, driver, Python and package versions
#   setup.log              what pip installed (only when something was missing)
#   pytest-cuda.log        the CUDA tests of the pool (IPC handle opened in another process, device
#   junit-cuda.xml         UUID check), the pinned swap tier on a side stream, the real device
#                          memory plan and replica check, the model runner's Triton path vs generate,
#                          the prefix cache's pinned host tier and a cuda pool's keep/promote via disk,
#                          the vLLM connector's worker side (CUDA IPC attach, saves and loads device
#                          to device between two engines' caches in vLLM's FlashAttention layout)
#   pytest-kernels.log     tests/test_kernels_triton.py on the GPU (realistic shapes)
#   junit-kernels.xml
#   bench-decode.txt       bench/decode_attention.py: paged vs contiguous, KV-read bandwidth as a
#   decode_attention.png   fraction of the device's peak (its last line is the headline)
#   bench-swap.txt, swap.json   bench/swap.py: swap out / in GB/s vs this device's pinned-copy GB/s
#   gpu-stack.txt          bench/gpu_stack.py: a cuda cache service + 2 compute replicas running a
#   gpu_stack/             seeded random ~1.1B Llama in bfloat16 built in code; greedy parity vs HF
#                          generate (bf16 through the stack, fp32 through the runner), serving
#                          throughput vs generate and generate_batch; gpu_stack.json; cache.log (the
#                          logged device memory plan), compute-*.log
#   connector-copies.txt   bench/vllm_connector.py --copies-only: the connector's load / save GB/s
#                          device to device vs a plain copy of the same blocks (TinyLlama's geometry)
#   vllm-connector.txt     bench/vllm_connector.py --quick (issue 33), when vLLM's CUDA build is
#                          installed (never installed here: it brings its own torch): a cuda cache
#                          service and three vLLM engines on the device, TTFT of a prefix another
#                          engine computed (loaded by CUDA IPC, device to device) vs recompute,
#                          throughput with/without KvtierConnector, load/save GB/s vs a plain copy
#   summary.txt            each step's exit status and time, then every headline
#
# Usage:
#   OUT=/path/to/results scripts/gpu_evidence.sh            # on a machine with a CUDA torch
#   scripts/gpu_evidence.sh --dry-run                       # CPU: check the steps are wired
#   GPU_EVIDENCE_DRY_RUN=1 scripts/gpu_evidence.sh          # the same
# Environment: PYTHON (default ./.venv/bin/python if present, else python3), OUT, BUDGET_S (570),
# GPU_EVIDENCE_NO_INSTALL=1 (never run pip).
#
# What the machine needs: an NVIDIA GPU and a Python >= 3.11 with a CUDA build of torch (triton
# comes with it). What else is missing (grpcio, transformers, pytest, hypothesis, CuPy matching
# torch's CUDA for the cuda pool, ...) is installed with pip into that interpreter, package by
# package, with the installed torch and triton pinned by a constraints file, so pip never
# replaces them.
# Without an index pip fails fast and the steps that need the missing package report it.
set -uo pipefail
DRY=${GPU_EVIDENCE_DRY_RUN:-0}
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 64 ;;
    esac
done
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-evidence}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
# The repo root on the path: every package imports without installing the project.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
BUDGET_S=${BUDGET_S:-570}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
started=$(date +%s)
failures=0
log() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME CAP_S LOGFILE COMMAND...: run with timeout min(CAP_S, what is left of the budget),
# output to the console and LOGFILE, one line in the summary. In a dry run the command is given
# as it is (each dry command is a cheap wiring check).
step() {
    local name=$1 cap=$2 logfile=$3
    shift 3
    local left=$((BUDGET_S - ($(date +%s) - started)))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 15 ]; then
        log "step $name: SKIPPED (budget of ${BUDGET_S}s spent)"
        failures=$((failures + 1))
        return 1
    fi
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$logfile" 2>&1
    rc=$?
    cat "$logfile"
    local what="exit $rc"
    [ "$rc" -eq 124 ] && what="TIMED OUT after ${limit}s (exit 124)"
    log "step $name: $what ($(($(date +%s) - t0)) s)"
    [ "$rc" -ne 0 ] && failures=$((failures + 1))
    return "$rc"
}

# The pip packages of the modules the steps import that this interpreter lacks (module:package).
missing_packages() {
    local cupy_pkg=cupy-cuda12x
    if [ "$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")" -ge 13 ]; then
        cupy_pkg=cupy-cuda13x
    fi
    "$PY" - "$cupy_pkg" <<'EOF'
import importlib
import sys

NEEDED = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_status": "grpcio-status",
    "google.protobuf": "protobuf",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.instrumentation.grpc": "opentelemetry-instrumentation-grpc",
    "opentelemetry.exporter.otlp.proto.grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "prometheus_client": "prometheus-client",
    "zmq": "pyzmq",
    "msgpack": "msgpack",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
    "cupy": sys.argv[1],
    "matplotlib": "matplotlib",
    "psutil": "psutil",  # transformers' continuous batching reads memory with it
}
missing = []
for module, package in NEEDED.items():
    try:
        importlib.import_module(module)
    except Exception:
        missing.append(package)
print(" ".join(missing))
EOF
}

# The CUDA tests, by node id: a dry run collects exactly these, so a renamed test breaks it.
CUDA_TESTS=(
    tests/test_pool.py::test_cuda_pool_is_shared_through_an_ipc_handle
    tests/test_host_cache.py::test_cuda_area_is_pinned_and_copies_on_a_side_stream
    tests/test_memory_plan.py::test_real_device_plan_and_replica_check
    tests/test_model.py::test_greedy_on_cuda_with_triton_kernels_matches_generate
    tests/test_host_cache.py::test_cuda_cache_sees_writes_queued_just_before_it
    tests/test_lower_tiers.py::test_a_cuda_pool_keeps_and_promotes_through_pinned_host_memory_and_disk
    "tests/test_vllm_worker_device.py::test_one_engine_s_saved_blocks_load_into_another_s_cache_byte_for_byte[cuda-saver]"
    "tests/test_vllm_worker_device.py::test_one_engine_s_saved_blocks_load_into_another_s_cache_byte_for_byte[cuda-loader]"
)
KERNEL_TESTS=(tests/test_kernels_triton.py)
PYTEST=("$PY" -m pytest -o addopts="" -p no:cacheprovider -q -rA)

if [ "$DRY" = 1 ]; then
    log "gpu_evidence DRY RUN ($PY): the steps' wiring, nothing measured"
    step bash-syntax 30 "$OUT/dry-bash.log" bash -n "$0"
    step help-cachesvc 60 "$OUT/dry-cachesvc.log" "$PY" -m kvtier.cachesvc --help
    step help-computesvc 60 "$OUT/dry-computesvc.log" "$PY" -m kvtier.computesvc --help
    step help-gpu-stack 60 "$OUT/dry-gpu-stack.log" "$PY" bench/gpu_stack.py --help
    step help-swap 60 "$OUT/dry-swap.log" "$PY" bench/swap.py --help
    step help-decode 90 "$OUT/dry-decode.log" "$PY" bench/decode_attention.py --help
    step help-vllm-connector 60 "$OUT/dry-vllm-connector.log" "$PY" bench/vllm_connector.py --help
    log "setup (not run): pip would install, torch and triton pinned: $(missing_packages)"
    step collect-tests 120 "$OUT/dry-collect.log" "${PYTEST[@]}" --collect-only "${CUDA_TESTS[@]}" "${KERNEL_TESTS[@]}"
    log "dry run: $failures step(s) failed; elapsed $(($(date +%s) - started)) s; results in $OUT"
    [ "$failures" -eq 0 ]
    exit
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $PY ($("$PY" --version 2>&1))"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 || echo "nvidia-smi unavailable"
    "$PY" - <<'EOF' 2>&1
import importlib
for name in ("torch", "triton", "cupy", "transformers", "grpc", "numpy", "pytest", "hypothesis", "matplotlib", "flashinfer", "vllm"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__})")
import torch
print("torch.cuda:", torch.version.cuda, "available:", torch.cuda.is_available(),
      "device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info(0)
    print(f"device memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
EOF
} >"$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "FATAL: $PY has no CUDA torch + triton (see env.txt); nothing to run (--dry-run checks the wiring on CPU)"
    exit 2
fi

# The folders cachesvc/, computesvc/, kernels/ and gateway/ import only as kvtier.* through the
# install's package-dir mapping: an interpreter without kvtier installed gets this checkout,
# editable, with nothing fetched (no dependencies, no index, no build isolation).
if ! "$PY" -c "import kvtier.cachesvc, kvtier.kernels" >/dev/null 2>&1; then
    step install-kvtier 120 "$OUT/install-kvtier.log" \
        "$PY" -m pip install --no-deps --no-index --no-build-isolation -e "$ROOT"
fi

# Setup: install what is missing, never replacing the CUDA torch / triton.
missing=$(missing_packages)
if [ -n "$missing" ] && [ "${GPU_EVIDENCE_NO_INSTALL:-0}" != 1 ]; then
    log "missing: $missing; installing with pip (torch and triton pinned)"
    "$PY" -c "
import importlib.metadata as m
for d in ('torch', 'triton'):
    try:
        print(f'{d}=={m.version(d)}')
    except m.PackageNotFoundError:
        pass" >"$OUT/constraints.txt"
    # shellcheck disable=SC2086  # one word per package
    if ! step setup 240 "$OUT/setup.log" "$PY" -m pip install --retries 1 --timeout 15 -c "$OUT/constraints.txt" $missing; then
        failures=$((failures - 1))  # not a failure of its own: the steps that need a package report it
        log "setup failed (no index?): still missing: $(missing_packages)"
    fi
else
    log "setup: nothing missing${missing:+ (install skipped: $missing)}"
fi

# In order of what the evidence needs most, so a spent budget cuts the least: the pool and runner
# on the device, the whole stack, the swap tier, then the kernel grid and its benchmark.
step pytest-cuda 150 "$OUT/pytest-cuda.log" "${PYTEST[@]}" --junitxml="$OUT/junit-cuda.xml" "${CUDA_TESTS[@]}"
step gpu-stack 300 "$OUT/gpu-stack.txt" "$PY" bench/gpu_stack.py --out "$OUT/gpu_stack" --budget-s 250
step bench-swap 45 "$OUT/bench-swap.txt" "$PY" bench/swap.py --json "$OUT/swap.json"
# kvtier as vLLM's KV cache on the device (CUDA IPC attach, device-to-device loads and saves).
if "$PY" -c "import vllm" >/dev/null 2>&1; then
    step vllm-connector 200 "$OUT/vllm-connector.txt" "$PY" bench/vllm_connector.py --quick
else
    log "step vllm-connector: SKIPPED (vLLM is not installed for $PY; pip install 'kvtier[vllm]' to include it)"
    step connector-copies 60 "$OUT/connector-copies.txt" "$PY" bench/vllm_connector.py --copies-only \
        --hidden 2048 --layers 22 --heads 32 --kv-heads 4
fi
step pytest-kernels 150 "$OUT/pytest-kernels.log" "${PYTEST[@]}" --junitxml="$OUT/junit-kernels.xml" "${KERNEL_TESTS[@]}"
step bench-decode 120 "$OUT/bench-decode.txt" "$PY" bench/decode_attention.py --plot "$OUT/decode_attention.png"

{
    echo
    echo "headlines:"
    for f in pytest-cuda.log pytest-kernels.log; do
        [ -f "$OUT/$f" ] && echo "  $f: $(tail -1 "$OUT/$f")"
    done
    [ -f "$OUT/bench-decode.txt" ] && echo "  decode attention: $(tail -1 "$OUT/bench-decode.txt")"
    [ -f "$OUT/bench-swap.txt" ] && grep '^headline' "$OUT/bench-swap.txt" | sed 's/^/  swap: /'
    [ -f "$OUT/gpu-stack.txt" ] && grep '^headline' "$OUT/gpu-stack.txt" | sed 's/^/  stack: /'
    [ -f "$OUT/vllm-connector.txt" ] && echo "  vLLM connector: $(tail -1 "$OUT/vllm-connector.txt")"
    [ -f "$OUT/connector-copies.txt" ] && echo "  connector copies: $(tail -1 "$OUT/connector-copies.txt")"
    [ -f "$OUT/gpu_stack/cache.log" ] && echo "  device memory plan (cache service log):" \
        && grep -A8 'device memory plan for' "$OUT/gpu_stack/cache.log" | sed 's/^/    /'
} | tee -a "$SUMMARY"
log "$failures step(s) failed; elapsed $(($(date +%s) - started)) s; results in $OUT"
[ "$failures" -eq 0 ]
