"""bench/tiers.py, bench/tiers_restart.py and bench/swap.py --quick run end to end and measure what
they name.

Their targets (host and disk loads against recompute, hit rates against the ideal and across a
restart) are printed by the benchmarks, not asserted here: a loaded CI machine must not fail a
speed claim. What is asserted is that each measures the tier it names: the restart benchmark's
disk was written and rebuilt (it once measured nothing of the disk when the host cache became
a default and took every eviction), and no promoted block held the wrong bytes; the swap
benchmark moves its sequence through swap's share of the host cache's area (it once imported a
swap tier that had been deleted, and no test ran it).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_bench(name: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()


def test_the_restart_bench_rebuilds_the_disk_it_wrote_after_a_sigkill():
    lines = run_bench("tiers_restart.py")
    (indexed,) = [line for line in lines if "records indexed after the restart" in line]
    records = int(re.search(r"(\d+) records indexed", indexed).group(1))
    assert records > 0, indexed  # the scan found what the first service wrote before SIGKILL
    rates = re.search(r"hit rate before the restart ([\d.]+), after ([\d.]+)", "\n".join(lines))
    assert rates and float(rates.group(1)) > 0 and float(rates.group(2)) > 0, lines
    assert lines[-1].startswith("headline: after SIGKILL + restart"), lines[-1]


def test_the_tiers_bench_promotes_only_the_right_bytes_and_hits_below_the_device():
    lines = run_bench("tiers.py")
    (hits,) = [line for line in lines if line.startswith("hit rate")]
    assert hits.endswith("wrong promoted blocks 0"), hits
    rate = {k: float(v) for k, v in re.findall(r"(device|\+host|\+host\+disk|ideal) ([\d.]+)", hits)}
    assert rate["device"] < rate["+host"] < rate["+host+disk"] <= rate["ideal"], hits
    assert lines[-1].startswith("headline: a 512-token prefix from host memory"), lines[-1]


def test_the_swap_bench_swaps_through_the_host_cache_s_area_and_gets_the_bytes_back(tmp_path: Path):
    out = tmp_path / "swap.json"
    lines = run_bench("swap.py", "--json", str(out))  # it checks the sequence's bytes itself
    r = json.loads(out.read_text())
    rounds = r["repeats"] + 1  # one untimed round first
    assert r["swap_out_blocks"] == r["swap_in_blocks"] == rounds * r["batch_blocks"] > 0, r
    # The host cache was full before each timed SwapOut: its reserve gave up one cached block a slot.
    assert r["cached_blocks_given_up"] == r["repeats"] * r["batch_blocks"], r
    assert r["batch_bytes"] == r["batch_blocks"] * r["block_bytes"] > 0, r
    rates = ("swap_out_gbs", "swap_in_gbs", "baseline_d2h_gbs", "baseline_h2d_gbs")
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in rates), r
    assert lines[-1].startswith("headline: swap out "), lines[-1]
