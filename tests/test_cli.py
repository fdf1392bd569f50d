"""The `kvtier` CLI, as a person runs it: the README's main job works end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from servers import TOKEN, child_env

from kvtier.cli.stack import Process, wait_gateway

REPO = Path(__file__).resolve().parent.parent
KVTIER = str(Path(sys.executable).parent / "kvtier")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env["KVTIER_RUN_DIR"] = str(tmp_path / "unused")
    return env


def test_help_lists_every_subcommand():
    out = subprocess.run([KVTIER, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("cache", "compute", "serve", "up", "demo", "generate", "stats"):
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


def test_serve_help_explains_every_flag():
    out = subprocess.run([KVTIER, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in (
        "--host",
        "--port",
        "--compute",
        "--api-key",
        "--served-model-name",
        "--model",
        "--token-file",
    ):
        assert flag in out, flag
    assert "OpenAI-compatible" in out and "KVTIER_API_KEY" in out and "(default: 8000)" in out
    # Usage names the command the user typed; a flag without a value shows no "(default: True)".
    assert out.startswith("usage: kvtier serve ") and "python -m kvtier.gateway" not in out
    assert "(default: True)" not in out and "(default: False)" not in out
    for command in ("cache", "compute"):
        bad = subprocess.run([KVTIER, command, "--no-such-flag"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and f"kvtier {command}: error: unrecognized arguments" in bad.stderr


def test_up_help_states_the_defaults_that_differ_from_a_hand_started_service():
    out = subprocess.run([KVTIER, "up", "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "a hand-started `kvtier cache` defaults to 4" in flat  # --swap-space 0.25 here
    assert "a hand-started `kvtier cache` sizes its pool from memory" in flat  # --num-blocks 2048 here
    assert "0 = off (default: auto, as a hand-started `kvtier cache`)" in flat  # --host-cache-gib
    cache = subprocess.run([KVTIER, "cache", "--help"], capture_output=True, text=True, check=True).stdout
    assert "0 = no host cache" in cache and "(default: auto)" in " ".join(cache.split())
    for flag in ("--routing", "--routing-load-weight", "--block-size", "--threads", "--compute-flag"):
        assert flag in out, flag


def _read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> tuple[re.Match, str]:
    """Read proc's stdout until it matches `pattern` (fails with what it printed after timeout_s)."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=1.0):
            seen += os.read(fd, 65536).decode(errors="replace")
            if m := re.search(pattern, seen):
                return m, seen
    raise AssertionError(
        f"no line matching {pattern!r} within {timeout_s:.0f}s (exit {proc.poll()}):\n{seen}"
    )


def test_up_starts_the_gateway_prints_its_url_and_serve_finds_the_stack(tmp_path):
    env = _env(tmp_path)
    env["KVTIER_RUN_DIR"] = str(tmp_path / "run")
    up = subprocess.Popen(
        [KVTIER, "up", "--replicas", "1", "--num-blocks", "256", "--gateway-port", "0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    serve = None
    try:
        m, printed = _read_until(up, r"OpenAI API:\s+(http://127\.0\.0\.1:\d+)/v1", 240)
        url = m.group(1)
        assert "+ the HTTP gateway" in printed
        assert json.loads((tmp_path / "run" / "stack.json").read_text())["gateway"] == url
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        reply = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=120
        ).json()
        assert reply["usage"]["completion_tokens"] <= 3 and reply["model"] == "kvtier-tiny"
        # `kvtier serve` with no --compute serves the running stack's replicas.
        with open(tmp_path / "serve.log", "w") as log:
            proc = subprocess.Popen(
                [KVTIER, "serve", "--port", "0", "--served-model-name", "tiny"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        serve = wait_gateway(Process("serve", proc, "", tmp_path / "serve.log"))
        assert "compute replicas (1): unix://" in serve.log()
        models = httpx.get(f"{serve.address}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    finally:
        if serve is not None:
            serve.stop()
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    assert not (tmp_path / "run" / "stack.json").exists()


def test_a_cache_service_started_without_the_flag_keeps_a_share_of_host_memory(tmp_path):
    """issue 22: `--host-cache-gib` defaults to auto. A service started without it (and without
    swap space, so the host area is the host cache's alone) reports a host tier in GetStats, and
    its log names the size it chose and why; the pool line's host area is that size."""
    from kvtier.cache_client import CacheClient
    from kvtier.cli.stack import LocalStack

    stack = LocalStack(
        tmp_path,
        cache_args=["--num-blocks", "64", "--swap-space", "0"],
        num_replicas=0,
        env=child_env(tmp_path),
    )
    try:
        service = stack.start_cache()
        client = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=5.0)
        try:
            stats = client.get_stats()
        finally:
            client.close()
        log = service.log()
        printed = subprocess.run(
            [KVTIER, "stats", "--cache", stack.cache_address],
            env=child_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stack.down()
    assert stats.num_host_blocks_total > 0 and stats.num_host_blocks_used == 0, stats
    # `kvtier stats` prints every field, zeros too (proto3 JSON would drop them).
    assert printed.returncode == 0, printed.stderr
    shown = json.loads(printed.stdout)
    assert shown["num_host_blocks_used"] == 0 and shown["num_sequences"] == 0, shown
    assert shown["num_host_blocks_total"] == stats.num_host_blocks_total
    assert set(shown) >= {f.name for f in dataclasses.fields(stats)}, set(shown) ^ {
        f.name for f in dataclasses.fields(stats)
    }
    assert "host" in [tier.medium for tier in stats.tiers], stats.tiers
    chosen = re.search(r"host cache: ([\d.]+ [KMG]iB), the default \(--host-cache-gib auto: (.+?);", log)
    assert chosen, log[-3000:]
    area = re.search(r"host area \(swap\): (\d+) blocks \(([\d.]+ [KMG]iB)\)", log)
    assert area and int(area.group(1)) == stats.num_host_blocks_total, log[-3000:]
    assert area.group(2) == chosen.group(1), (area.group(0), chosen.group(0))
    why = chosen.group(2)  # which bound of min(cap, share of the memory available) chose it
    assert "of the memory available is more" in why or "available to this process" in why, why
