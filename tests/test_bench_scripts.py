"""tests/bench_scripts.py: a test imports a bench/ script without bench/ on sys.path afterwards."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench_scripts import bench_script

TESTS = Path(__file__).resolve().parent


def test_a_bench_script_and_its_siblings_load_once_under_bench_names_only():
    path = sys.path[:]
    report = bench_script("serve_report")  # imports serve_load and serve_workloads by plain name
    assert sys.path == path
    assert not {"serve_report", "serve_load", "serve_workloads"} & set(sys.modules)
    assert bench_script("serve_workloads").WORKLOADS is report.WORKLOADS
    assert bench_script("serve_report") is report


def test_no_test_module_puts_bench_on_sys_path():
    """One did at import: from collection on, bench's `router`, `tiers`, `swap`, ... came first
    for every import of the session."""
    insert = re.compile(r"sys\.path\.(insert|append)\([^\n]*bench")
    offenders = [f.name for f in sorted(TESTS.glob("*.py")) if insert.search(f.read_text())]
    assert offenders == [], offenders
