"""The `kvtier` CLI, as a person runs it: the README's main job works end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KVTIER = str(Path(sys.executable).parent / "kvtier")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env["KVTIER_RUN_DIR"] = str(tmp_path / "unused")
    return env


def test_help_lists_every_subcommand():
    out = subprocess.run([KVTIER, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("cache", "compute", "up", "demo", "generate", "stats"):
        assert command in out


def test_demo_starts_a_fresh_stack_serves_the_workload_and_stops_it(tmp_path):
    result = subprocess.run(
        [KVTIER, "demo", "--fresh", "--requests", "12", "--max-tokens", "8", "--concurrency", "6"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("demo: 12 requests"), last
    hit_rate = float(last.split("prefix hit rate ")[1].rstrip("%"))
    assert hit_rate > 30  # four shared system prompts over twelve requests
    assert "prefix hit rate" in result.stdout and "TTFT p50 / p99" in result.stdout
    # The stack is gone: no process still serves from the fresh run directory (other stacks on
    # the machine, in other run directories, are none of this test's business).
    run_dir = result.stdout.split("starting the local stack in ", 1)[1].split(":", 1)[0]
    leftover = subprocess.run(["pgrep", "-f", f"{run_dir}/"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


def test_generate_streams_one_completion(tmp_path):
    result = subprocess.run(
        [KVTIER, "generate", "Hello", "--fresh", "--replicas", "1", "--max-tokens", "5"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[length: 6 prompt tokens (0 cached), 5 completion tokens]" in result.stderr
