"""Pool backends: real shared memory mapped by independent (spawned) processes, and CUDA IPC where present."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.cuda_pool import CudaPool
from kvtier.pool import (
    PoolSpec,
    PoolUnavailable,
    ShmPool,
    attach_pool,
    pool_shape,
    remove_stale_segments,
)

REPO = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter (subprocess, not fork): maps the segment by name, checks what the
# parent wrote, writes its own pattern, and exits (which must not unlink the segment).
CHILD = """
import json, sys, torch
from kvtier.pool import PoolSpec, attach_pool
spec = PoolSpec(**json.loads(sys.argv[1]))
pool = attach_pool(spec)
seen = float(pool.tensor[3, 1, 0].flatten()[0])
pool.tensor[5].fill_(7.25)
print(json.dumps({"seen": seen, "shape": list(pool.tensor.shape)}))
"""


def _spec_json(spec: PoolSpec) -> str:
    d = dict(spec.__dict__)
    d["cuda_ipc_handle"] = ""
    return json.dumps(d)


def test_shm_pool_is_shared_with_an_independent_process_and_survives_its_exit():
    shape = pool_shape(8, 2, 16, 2, 8)
    pool = ShmPool.create(shape, "float32", model_fingerprint="f", vocab_size=10, max_model_len=64)
    try:
        path = Path("/dev/shm") / pool.spec.shm_name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert pool.spec.strides[0] == 2 * 2 * 16 * 2 * 8
        pool.tensor[3].fill_(-1.5)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, _spec_json(pool.spec)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply == {"seen": -1.5, "shape": shape}
        assert torch.all(pool.tensor[5] == 7.25)
        assert torch.all(pool.tensor[4] == 0)
        # The child's exit must not have unlinked our segment (resource-tracker trap).
        assert path.exists()
        assert "leaked shared_memory" not in out.stderr
    finally:
        pool.close()
    assert not (Path("/dev/shm") / pool.spec.shm_name).exists()


def test_bfloat16_pool_views_share_bytes():
    pool = ShmPool.create(pool_shape(2, 1, 16, 1, 8), "bfloat16")
    try:
        other = ShmPool.attach(pool.spec)
        pool.tensor[1].fill_(0.5)
        assert other.tensor.dtype == torch.bfloat16 and torch.all(other.tensor[1] == 0.5)
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_a_quantized_pool_keeps_each_blocks_scales_inside_the_block(dtype):
    layers, block_size, heads, head_dim = 2, 16, 2, 8
    pool = ShmPool.create(pool_shape(3, layers, block_size, heads, head_dim), dtype)
    try:
        elements = layers * 2 * block_size * heads * head_dim  # one byte each
        block_bytes = elements + layers * 2 * block_size * heads * 4
        assert pool.spec.block_bytes == block_bytes and pool.spec.size_bytes == 3 * block_bytes
        assert pool.spec.strides[0] == block_bytes and pool.tensor.element_size() == 1
        assert pool.scales.shape == (3, layers, 2, block_size, heads) and pool.scales.dtype == torch.float32
        assert pool.rows.shape == (3, block_bytes)
        other = attach_pool(pool.spec)
        pool.tensor[1, 1, 0, 5, 1] = torch.full((head_dim,), 3.0).to(pool.tensor.dtype)
        pool.scales[1, 1, 0, 5, 1] = 0.25
        assert torch.all(other.tensor[1, 1, 0, 5, 1].float() == 3.0)
        assert other.scales[1, 1, 0, 5, 1] == 0.25
        # Block 1 changed only inside its own row: elements first, then the float32 scales.
        touched = (other.rows != 0).nonzero()[:, 0].unique().tolist()
        assert touched == [1]
        scale_at = elements + ((1 * 2 + 0) * block_size + 5) * heads * 4 + 4
        assert other.rows[1, scale_at : scale_at + 4].view(torch.float32).item() == 0.25
        other.close()
    finally:
        pool.close()


def test_attach_to_a_missing_segment_says_why():
    spec = PoolSpec("cpu-shm", "float32", [1, 1, 2, 16, 1, 8], [1] * 6, 1024, 16, shm_name="kvtier-0-missing")
    with pytest.raises(PoolUnavailable, match="does not exist"):
        attach_pool(spec)


def test_unknown_dtype_and_backend_are_refused():
    with pytest.raises(ValueError, match="float64"):
        ShmPool.create([1, 1, 2, 16, 1, 8], "float64")
    spec = PoolSpec("tpu", "float32", [1, 1, 2, 16, 1, 8], [1] * 6, 1024, 16)
    with pytest.raises(PoolUnavailable, match="tpu"):
        attach_pool(spec)


def test_stale_segments_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"kvtier-{dead_pid}-abcd"
    live = tmp_path / f"kvtier-{os.getpid()}-abcd"
    other = tmp_path / "unrelated"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert remove_stale_segments(str(tmp_path)) == [stale.name]
    assert live.exists() and other.exists() and not stale.exists()


def test_cuda_backend_is_unavailable_without_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: see test_cuda_pool_is_shared_through_an_ipc_handle")
    with pytest.raises(PoolUnavailable, match="cuda backend|CuPy"):
        CudaPool.create(pool_shape(2, 1, 16, 1, 8), "float16")


CUDA_CHILD = """
import base64, json, sys, torch
from kvtier.pool import PoolSpec, attach_pool
d = json.loads(sys.argv[1]); d["cuda_ipc_handle"] = base64.b64decode(d["cuda_ipc_handle"])
pool = attach_pool(PoolSpec(**d))
seen = float(pool.tensor[1].flatten()[0])
pool.tensor[0].fill_(3.0); torch.cuda.synchronize()
print(json.dumps({"seen": seen}))
"""


def test_cuda_pool_is_shared_through_an_ipc_handle():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the cuda backend is tested on the GPU machine")
    import base64

    pool = CudaPool.create(pool_shape(4, 2, 16, 2, 64), "bfloat16")
    try:
        assert pool.spec.device_uuid.startswith("GPU-") and len(pool.spec.cuda_ipc_handle) == 64
        pool.tensor[1].fill_(-2.0)
        torch.cuda.synchronize()
        d = dict(pool.spec.__dict__)
        d["cuda_ipc_handle"] = base64.b64encode(pool.spec.cuda_ipc_handle).decode()
        out = subprocess.run(
            [sys.executable, "-c", CUDA_CHILD, json.dumps(d)], cwd=REPO, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"seen": -2.0}
        assert torch.all(pool.tensor[0] == 3.0)
        wrong = PoolSpec(**{**pool.spec.__dict__, "device_uuid": "GPU-00000000-0000-0000-0000-000000000000"})
        with pytest.raises(PoolUnavailable, match="cannot see"):
            attach_pool(wrong)
    finally:
        pool.close()
