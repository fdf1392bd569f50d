"""`kvtier up` / `kvtier down` as an operator uses them: signals stop everything, nothing is orphaned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli.stack_file import STACK_FILE

REPO = Path(__file__).resolve().parent.parent
KVTIER = str(Path(sys.executable).parent / "kvtier")


def _env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(run_dir), KVTIER_TOKEN="lifecycle-token", PYTHONUNBUFFERED="1")
    return env


def ignore_sigint() -> None:
    """What a non-interactive shell does to a command it starts in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_up(
    run_dir: Path, deadline_s: float = 240.0, extra: tuple[str, ...] = ("--no-gateway",)
) -> tuple[subprocess.Popen, dict]:
    """`kvtier up` with one replica and no gateway (unless `extra` says otherwise), started as a
    background job of a script (SIGINT ignored), read until it says the stack serves."""
    proc = subprocess.Popen(
        [KVTIER, "up", "--replicas", "1", "--num-blocks", "64", *extra],
        cwd=REPO,
        env=_env(run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ignore_sigint,
    )
    deadline = time.monotonic() + deadline_s
    seen = []
    for line in proc.stdout:  # each line is progress; the deadline bounds the whole start
        seen.append(line)
        if "Ctrl-C or `kvtier down` stops" in line:
            proc.printed = "".join(seen)  # what it said while starting
            return proc, json.loads((run_dir / STACK_FILE).read_text())
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"kvtier up exited with {proc.wait()}:\n{''.join(seen)}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_all_gone(pids, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)  # polling process exits with a deadline
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"]
)
def test_a_signal_to_kvtier_up_stops_every_process_it_started(tmp_path, sig):
    proc, info = start_up(tmp_path)
    services = list(info["pids"].values())
    assert len(services) == 2 and all(alive(p) for p in services)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert wait_all_gone(services) == [], "kvtier up left services running"
    assert not (tmp_path / STACK_FILE).exists()


def test_kvtier_down_stops_a_stack_started_in_another_shell(tmp_path):
    proc, info = start_up(tmp_path)
    services = list(info["pids"].values())
    down = subprocess.run(
        [KVTIER, "down"], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0, down.stderr
    assert "stopped kvtier up" in down.stdout
    assert proc.wait(timeout=60) == 0
    assert wait_all_gone(services) == []


def test_kvtier_down_stops_services_whose_kvtier_up_was_killed(tmp_path):
    proc, info = start_up(tmp_path)
    services = list(info["pids"].values())
    proc.kill()  # SIGKILL: kvtier up cannot stop anything; its services are orphans now
    proc.wait(timeout=30)
    assert all(alive(p) for p in services)
    down = subprocess.run(
        [KVTIER, "down"], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0, down.stderr
    assert "cache (pid" in down.stdout and "compute-0 (pid" in down.stdout
    assert wait_all_gone(services) == []


def test_kvtier_down_with_no_stack_says_so(tmp_path):
    down = subprocess.run([KVTIER, "down"], env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert down.returncode == 0
    assert "no stack runs in" in down.stdout


def test_kvtier_stats_without_a_stack_or_a_token_is_one_line(tmp_path):
    env = _env(tmp_path)
    no_stack = subprocess.run([KVTIER, "stats"], env=env, capture_output=True, text=True, timeout=60)
    assert no_stack.returncode == 1
    assert "UNAVAILABLE" in no_stack.stderr and "Traceback" not in no_stack.stderr
    del env["KVTIER_TOKEN"]
    no_token = subprocess.run([KVTIER, "stats"], env=env, capture_output=True, text=True, timeout=60)
    assert no_token.returncode == 1
    assert "no cache service token" in no_token.stderr and "Traceback" not in no_token.stderr


def test_every_entry_point_has_a_version():
    from kvtier import __version__

    for argv in (
        [KVTIER],
        [sys.executable, "-m", "kvtier.cachesvc"],
        [sys.executable, "-m", "kvtier.computesvc"],
    ):
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip().endswith(__version__), out.stdout


def test_kvtier_up_with_two_nodes_routes_across_them_and_stops_them_all(tmp_path):
    """`kvtier up --nodes 2`: two cache services (a pool each) with their replicas and one gateway
    routing across them; the stack file names the nodes; a clear error for --nodes 0."""
    import httpx
    import openai

    bad = subprocess.run([KVTIER, "up", "--nodes", "0"], env=_env(tmp_path), capture_output=True, text=True)
    assert bad.returncode != 0 and "--nodes must be >= 1" in bad.stderr
    extra = ("--nodes", "2", "--gateway-port", "0", "--routing", "round-robin", "--block-size", "32")
    proc, info = start_up(
        tmp_path, extra=(*extra, "--threads", "1", "--compute-flag=--max-num-batched-tokens=512")
    )
    try:
        assert [n["name"] for n in info["nodes"]] == ["node-0", "node-1"]
        assert info["nodes"][0]["cache"] != info["nodes"][1]["cache"]
        # It prints the gateway and every metrics URL; `kvtier stats` shows each node and totals.
        assert f"OpenAI API:       {info['gateway']}/v1" in proc.printed
        for url in info["metrics"].values():
            assert f"metrics:          {url}" in proc.printed
        stats = subprocess.run(
            [KVTIER, "stats"], env=_env(tmp_path), capture_output=True, text=True, timeout=60
        )
        assert stats.returncode == 0, stats.stderr
        stats = json.loads(stats.stdout)
        assert sorted(stats["nodes"]) == ["node-0", "node-1"]
        assert {n["block_size"] for n in stats["nodes"].values()} == {32}  # --block-size reached the caches
        assert stats["totals"]["num_blocks_total"] == 2 * 64
        client = openai.OpenAI(base_url=f"{info['gateway']}/v1", api_key="unused", max_retries=0, timeout=120)
        for k in range(4):
            reply = client.completions.create(
                model="kvtier-tiny", prompt=[1, 2, 3, k], max_tokens=2, temperature=0
            )
            assert reply.usage.completion_tokens == 2
        services = list(info["pids"].values())
        assert len(services) == 2 * 2 + 1
        assert (
            'kvtier_router_decisions_total{reason="round_robin"} 4.0'
            in httpx.get(f"{info['gateway']}/metrics", timeout=30).text
        )  # --routing reached the gateway
        compute_log = (tmp_path / "node-0" / "compute-0.log").read_text()
        assert "max_num_batched_tokens=512" in compute_log, compute_log[-2000:]  # --compute-flag too
        # Every process serves metrics; the stack file names each endpoint (issue 12).
        import urllib.request

        assert sorted(info["metrics"]) == sorted(info["pids"])
        for url in info["metrics"].values():
            assert url.startswith("http://127.0.0.1:"), url
            assert "process_resident_memory_bytes" in urllib.request.urlopen(url, timeout=10).read().decode()
        # SIGKILL node 0's cache service: no request fails, `kvtier up` restarts it (the stack
        # file names the new pid) and node 0 gets traffic again once it answers.
        cache0 = next(name for name in info["pids"] if name.startswith("cache@") and "node-0" in name)
        os.kill(info["pids"][cache0], signal.SIGKILL)
        for k in range(6):
            reply = client.completions.create(
                model="kvtier-tiny", prompt=[1, 5, k], max_tokens=2, temperature=0
            )
            assert reply.usage.completion_tokens == 2
        restarted = wait_for(
            lambda: (
                (pid := json.loads((tmp_path / STACK_FILE).read_text())["pids"][cache0])
                != info["pids"][cache0]
                and alive(pid)
                and pid
            ),
            90.0,
            "the cache service restarted",
        )
        services.append(restarted)

        def node0_served() -> bool:
            client.completions.create(model="kvtier-tiny", prompt=[1, 6, 7], max_tokens=2, temperature=0)
            return node_requests(info["gateway"], "node-0") > before

        before = node_requests(info["gateway"], "node-0")
        wait_for(node0_served, 90.0, "node 0 serving again")
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert "cache exited (killed by SIGKILL)" in out and "cache restarted" in out, out
    assert wait_all_gone(services) == [], "kvtier up --nodes 2 left services running"


def test_kvtier_up_restarts_a_killed_replica_each_time_and_gives_up_when_it_keeps_dying(tmp_path):
    """SIGKILL the replica as soon as it is (re)started: `kvtier up` restarts it each time, with
    backoff, then stops the stack saying which service and why (5 fast failures in a row)."""
    proc, info = start_up(tmp_path)
    services = list(info["pids"].values())
    killed = set()
    try:
        while proc.poll() is None and len(killed) < 6:
            pids = (
                json.loads((tmp_path / STACK_FILE).read_text())["pids"]
                if (tmp_path / STACK_FILE).exists()
                else {}
            )
            pid = pids.get("compute-0")
            if pid and pid not in killed and alive(pid):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                services.append(pid)
            time.sleep(0.05)  # polling the stack file for the restarted replica's pid
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert out.count("compute-0 restarted") == 4, out
    assert "compute-0 exited 5 times in a row within 15s of starting (last: killed by SIGKILL)" in out, out
    assert "stopping the stack" in out
    assert wait_all_gone(services) == [], "kvtier up left services running after giving up"


def node_requests(gateway: str, node: str) -> float:
    """The gateway's kvtier_gateway_node_requests_total for `node`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gateway}/metrics", timeout=30).text
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvtier_gateway_node_requests_total" and s.labels.get("node") == node
    )


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns a truthy value (which is returned)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(0.1)  # polling a state change with a deadline
    return value
