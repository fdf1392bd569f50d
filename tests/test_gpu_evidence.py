"""scripts/gpu_evidence.sh: its dry run (bash syntax, every Python entry point's --help, the CUDA
tests it names are collected) passes on CPU, and on a machine without CUDA the real run stops at
once, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import bench_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_evidence.sh"


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.slow
def test_dry_run_checks_every_step_is_wired(tmp_path):
    out = _run(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    for step in (
        "bash-syntax",
        "help-cachesvc",
        "help-computesvc",
        "help-gpu-stack",
        "help-swap",
        "help-decode",
        "collect-tests",
    ):
        assert f"step {step}: exit 0" in summary, summary
    assert "dry run: 0 step(s) failed" in summary
    collected = (tmp_path / "dry-collect.log").read_text()
    assert "test_cuda_pool_is_shared_through_an_ipc_handle" in collected
    assert "test_greedy_on_cuda_with_triton_kernels_matches_generate" in collected
    assert "--compute-replicas" in (tmp_path / "dry-cachesvc.log").read_text()


def test_unknown_argument_is_refused(tmp_path):
    out = _run(tmp_path, "--bogus")
    assert out.returncode == 64 and "unknown argument: --bogus" in out.stderr


def test_real_run_without_cuda_stops_and_says_why(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run is the evidence itself, not a test")
    out = _run(tmp_path, GPU_EVIDENCE_NO_INSTALL="1")
    assert out.returncode == 2
    assert "FATAL" in (tmp_path / "summary.txt").read_text()
    assert "available: False" in (tmp_path / "env.txt").read_text()


def test_gpu_stack_agreement_counts_exact_matches_and_the_agreeing_prefix():
    agreement = bench_script("gpu_stack").agreement

    got = [[1, 2, 3], [1, 2, 9], [7, 2, 3]]
    want = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    a = agreement(got, want)
    assert (a["exact"], a["prompts"], a["tokens_per_prompt"]) == (1, 3, 3)
    assert a["agreeing_prefix_tokens"] == [3, 2, 0] and a["mean_agreeing_prefix"] == 5 / 3
