"""kvtier installs under one import namespace beside the packages it runs with (issue 32, item 3).

One process imports transformers, Hugging Face's ``kernels`` (which transformers imports, and which
our own ``kernels/`` folder must never shadow), vLLM's CPU build and every kvtier entry point, from
the repository root (where ``kernels/`` and ``gateway/`` sit in the working directory) and from
another directory; the services' ``--help`` and the ``kvtier`` console script run from both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENTRY_POINTS = (
    "kvtier.cachesvc.__main__",
    "kvtier.computesvc.__main__",
    "kvtier.gateway.__main__",
    "kvtier.cli.cli",
    "kvtier.vllm.connector",
)
# The import order is what each kind of process does: a kvtier entry point (`python -m kvtier.x`, the
# console script) imports kvtier first, which takes the checkout root off sys.path; a program of the
# user's imports transformers first. (A bare `python -c "import kernels"` in the checkout root, which
# Python puts first on sys.path, finds the folder: nothing of kvtier runs there to take it off.)
KVTIER_FIRST = f"""
import importlib, json
modules = {{name: importlib.import_module(name).__file__ for name in {list(ENTRY_POINTS)!r}}}
import transformers, kernels, vllm
print(json.dumps({{"kernels": kernels.__file__, "vllm": vllm.__file__, "modules": modules}}))
"""
TRANSFORMERS_FIRST = f"""
import importlib, json
import transformers, kernels, vllm
modules = {{name: importlib.import_module(name).__file__ for name in {list(ENTRY_POINTS)!r}}}
print(json.dumps({{"kernels": kernels.__file__, "vllm": vllm.__file__, "modules": modules}}))
"""


@pytest.mark.parametrize("cwd", ["repository root, kvtier first", "another directory, transformers first"])
def test_one_process_imports_transformers_hf_kernels_vllm_and_every_entry_point(cwd, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs its CPU build)")
    directory, script = (
        (REPO, KVTIER_FIRST) if cwd.startswith("repository") else (tmp_path, TRANSFORMERS_FIRST)
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=directory, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    kernels_file = Path(files["kernels"]).resolve()
    assert "site-packages" in kernels_file.parts, f"`kernels` is not Hugging Face's: {kernels_file}"
    assert kernels_file.parent != REPO / "kernels"
    assert "site-packages" in Path(files["vllm"]).resolve().parts
    for name, path in files["modules"].items():
        assert REPO in Path(path).resolve().parents, f"{name} loaded from {path}, not this checkout"


@pytest.mark.parametrize("cwd", ["repository root", "another directory"])
def test_services_help_and_the_console_script_run_from_any_directory(cwd, tmp_path):
    directory = REPO if cwd == "repository root" else tmp_path
    for command, usage in (
        ([sys.executable, "-m", "kvtier.cachesvc", "--help"], "usage: python -m kvtier.cachesvc"),
        ([str(Path(sys.executable).parent / "kvtier"), "--help"], "usage: kvtier"),
    ):
        done = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.startswith(usage), done.stdout[:500]
