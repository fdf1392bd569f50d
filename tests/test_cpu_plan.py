"""How compute uses a CPU box (kvtier.cpu_plan): the layout `kvtier up` chooses, the allocator it
preloads, and that both reach the startup lines (the stack's and each replica's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.cpu_plan import IOMP_NAMES, allocator_libs, plan_cpu, preload_env, usable_cpus

KVTIER = str(Path(sys.executable).parent / "kvtier")


def test_default_layout_is_one_replica_on_every_cpu():
    plan = plan_cpu(cpus=8)
    assert (plan.replicas, plan.threads) == (1, 8)
    assert "1 replica(s) x 8 thread(s) on 8 CPUs" in plan.describe()
    small = plan_cpu(cpus=2)  # a small box: a replica of one thread per CPU
    assert (small.replicas, small.threads) == (2, 1)
    assert "2 replica(s) x 1 thread(s) on 2 CPUs" in small.describe()
    assert (plan_cpu(cpus=1).replicas, plan_cpu(cpus=1).threads) == (1, 1)


def test_pinned_replicas_split_the_cpus_and_pinned_threads_fill_them():
    assert (plan_cpu(replicas=2, cpus=8).threads, plan_cpu(threads=2, cpus=8).replicas) == (4, 4)
    assert (plan_cpu(replicas=3, threads=5, cpus=2).replicas, plan_cpu(replicas=3, cpus=2).threads) == (3, 1)
    gpu = plan_cpu(cpus=8, device="cuda")
    assert (gpu.replicas, gpu.threads) == (2, 1)


def test_preload_env_puts_the_libraries_first_once_and_keeps_the_users():
    env = preload_env(
        {"LD_PRELOAD": "/x/libmine.so /a/libtcmalloc_minimal.so.4"}, ["/a/libtcmalloc_minimal.so.4"]
    )
    assert env["LD_PRELOAD"] == "/a/libtcmalloc_minimal.so.4 /x/libmine.so"
    assert "KMP_BLOCKTIME" not in env
    with_iomp = preload_env({"KMP_BLOCKTIME": "0"}, ["/v/lib/libiomp5.so"])
    assert with_iomp == {"KMP_BLOCKTIME": "0", "LD_PRELOAD": "/v/lib/libiomp5.so"}
    assert preload_env({}, ["/v/lib/libiomp5.so"])["KMP_BLOCKTIME"] == "5"
    assert preload_env({"A": "1"}, []) == {"A": "1"}


def test_kvtier_up_default_prints_its_layout_and_the_replica_runs_it(tmp_path):
    """No --replicas / --threads: the startup line names the chosen layout and preload, and the
    replica's own startup line shows it running that many threads with that allocator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env.update(KVTIER_RUN_DIR=str(tmp_path), KVTIER_TOKEN="cpu-plan-token", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [KVTIER, "up", "--no-gateway", "--num-blocks", "64"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # progress lines; the deadline bounds the whole start
            seen.append(line)
            if "Ctrl-C or `kvtier down` stops" in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        else:
            raise AssertionError(f"kvtier up exited with {proc.wait()}:\n{''.join(seen)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    printed = "".join(seen)
    cpus = usable_cpus()
    plan = plan_cpu(cpus=cpus)
    assert f"compute: {plan.replicas} replica(s) x {plan.threads} thread(s) on {cpus} CPUs" in printed, (
        printed
    )
    libs = allocator_libs()
    for lib in libs:
        assert Path(lib).name in printed
    replica_log = (tmp_path / "compute-0.log").read_text()
    running = re.search(r"CPU: (\d+) torch thread\(s\) of (\d+) usable CPUs, allocator (.+)", replica_log)
    assert running, replica_log[-3000:]
    assert (int(running[1]), int(running[2])) == (plan.threads, cpus)
    expected = ["tcmalloc"] * any("tcmalloc" in p for p in libs) + ["Intel OpenMP"] * any(
        Path(p).name in IOMP_NAMES for p in libs
    )
    assert running[3].startswith(" + ".join(expected) or "system malloc"), running[0]
