"""bench/http_api.py --quick runs end to end: both paths serve every request, the figures are sane.

The benchmark's targets (HTTP tok/s >= 0.95x gRPC, TTFT overhead <= 5 ms) are speed claims the
benchmark itself checks and prints, not asserted here: a loaded CI machine must not fail them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_quick_bench_serves_every_request_both_ways_and_prints_the_headline_last(tmp_path):
    out = tmp_path / "http.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "http_api.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=390,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert 20e6 < report["params"] < 35e6  # the ~27M-parameter random Llama
    for path in ("grpc", "http"):
        r = report[path]
        assert r["requests"] == 16 and r["errors"] == 0, r
        assert r["tokens"] == 16 * 16, r  # every request streamed all its tokens (EOS ignored)
        for metric in ("tok_per_s", "ttft_p50_ms", "path_ttft_p50_ms", "probe_ttft_p50_ms"):
            assert math.isfinite(r[metric]) and r[metric] > 0, (path, metric, r[metric])
    assert 0 < report["ratio"] < 10 and math.isfinite(report["ttft_overhead_ms"])
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("headline: HTTP ") and "vs gRPC" in last and "errors 0" in last, last
