"""Cache service RPC latency and throughput over the Unix socket, 1 / 8 / 32 client processes.

Each client process (spawned, not forked) attaches and loops for --seconds:
  alloc1    Allocate of one 16-token sequence
  alloc64   Allocate of 64 sequences (16 tokens each)
  extend64  Extend of those 64 sequences by 16 tokens (one new block each)
  free64    Free of the 64 sequences
  free1     Free of the one sequence
Baseline in the same run: the gRPC health Check, an empty round trip on the same socket. The
service's own time per call (mean, from its Prometheus histogram) is printed beside the client's
latency, so what the service adds can be told from what the transport costs.

    python bench/rpc.py                  # 1, 8, 32 clients, 3 s each
    python bench/rpc.py --quick          # 1 and 8 clients, 1 s each

Targets: alloc1 p50 <= 0.8 ms; extend64 p50 <= 2 ms; no errors at 32 clients.
The last line is the headline.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

OPS = ("health", "alloc1", "alloc64", "extend64", "free64", "free1")


def client_loop(address: str, token: str, seconds: float, seed: int, out: mp.Queue) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier.auth import grpc_target
    from kvtier.cache_client import CacheClient
    from kvtier.cache_errors import CacheCallError

    client = CacheClient.connect(address, token)
    client.attach(f"bench-{seed}")
    stop_beat = client.start_heartbeat_thread()
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(grpc_target(address)))
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    errors = 0
    # Distinct tokens per client and per round, so nothing is a prefix hit (pure block churn).
    base = seed * 10_000
    deadline = time.perf_counter() + seconds
    rounds = 0
    while time.perf_counter() < deadline:
        rounds += 1
        tok = [(base + rounds * 131 + i) % 250 for i in range(16)]
        try:
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest())
            t1 = time.perf_counter()
            one = client.allocate([tok])[0].sequence_id
            t2 = time.perf_counter()
            many = [s.sequence_id for s in client.allocate([tok] * 64)]
            t3 = time.perf_counter()
            client.extend([(s, 16) for s in many])
            t4 = time.perf_counter()
            client.free(many)
            t5 = time.perf_counter()
            client.free([one])
            t6 = time.perf_counter()
        except CacheCallError as e:
            errors += 1
            print(f"client {seed}: {e.code}: {e.details}", file=sys.stderr)
            continue
        for op, dt in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            lat[op].append(dt)
    stop_beat.set()
    out.put((lat, errors))


def server_seconds(port: int) -> dict[str, tuple[float, float]]:
    """Per method: (seconds spent, calls), summed over status codes, from the service's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    kind = {"kvtier_cache_rpc_duration_seconds_sum": 0, "kvtier_cache_rpc_duration_seconds_count": 1}
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvtier_cache_rpc_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name in kind:
                out.setdefault(sample.labels["method"], [0.0, 0.0])[kind[sample.name]] += sample.value
    return {method: (v[0], v[1]) for method, v in out.items()}


PROBE_CALLS = 1000


def split_probe(address: str, token: str, metrics_port: int) -> dict[str, tuple[float, float]]:
    """From this process: client p50 (ms) and the service's mean time (µs) of health Check and of
    one-sequence Allocate (each followed by a Free), PROBE_CALLS calls each."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier.auth import grpc_target
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(address, token)
    client.attach("bench-probe")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(grpc_target(address)))
    tokens = [7] * 16
    calls = {
        "Check": lambda: health.Check(health_pb2.HealthCheckRequest()),
        "Allocate": lambda: client.allocate([tokens])[0].sequence_id,
    }
    out = {}
    for method, call in calls.items():
        before = server_seconds(metrics_port).get(method, (0.0, 0.0))
        lat = []
        for _ in range(PROBE_CALLS):
            t0 = time.perf_counter()
            result = call()
            lat.append(time.perf_counter() - t0)
            if method == "Allocate":
                client.free([result])
        spent, count = server_seconds(metrics_port)[method]
        out[method] = (float(np.percentile(lat, 50)) * 1e3, (spent - before[0]) / (count - before[1]) * 1e6)
    client.close()
    return out


def run_level(address: str, token: str, clients: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=client_loop, args=(address, token, seconds, i, q)) for i in range(clients)]
    for p in procs:
        p.start()
    merged: dict[str, list[float]] = {op: [] for op in OPS}
    errors = 0
    for _ in procs:
        lat, err = q.get(timeout=seconds + 120)
        errors += err
        for op in OPS:
            merged[op] += lat[op]
    for p in procs:
        p.join()
    calls = sum(len(v) for v in merged.values())
    return {"lat": merged, "errors": errors, "calls_per_s": calls / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--quick", action="store_true", help="1 and 8 clients, 1 s each")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.seconds = [1, 8], 1.0

    from kvtier.cli.stack import LocalStack

    token = "bench-token"
    run_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-rpc-"))
    env = dict(os.environ, KVTIER_TOKEN=token)
    # 32 clients x 65 sequences x 2 blocks at most: 4160 blocks; give it room.
    stack = LocalStack(
        run_dir,
        ["--num-blocks", "8192", "--swap-space", "0", "--log-level", "INFO", "--metrics-port", "0"],
        num_replicas=0,
        env=env,
    )
    stack.start_cache()
    metrics_port = int(re.search(r"Prometheus metrics on http://[^:]+:(\d+)/", stack.cache.log()).group(1))
    rows = []
    try:
        for n in args.clients:
            r = run_level(stack.cache_address, token, n, args.seconds)
            row = {"clients": n, "errors": r["errors"], "calls_per_s": r["calls_per_s"]}
            for op in OPS:
                v = np.array(r["lat"][op]) * 1000
                row[f"{op}_p50"] = float(np.percentile(v, 50)) if len(v) else float("nan")
                row[f"{op}_p99"] = float(np.percentile(v, 99)) if len(v) else float("nan")
            rows.append(row)
        probe = split_probe(stack.cache_address, token, metrics_port)
    finally:
        stack.down()

    header = f"{'clients':>7} {'calls/s':>9} {'errors':>6} " + " ".join(
        f"{op + ' p50/p99 ms':>22}" for op in OPS
    )
    print(header)
    for row in rows:
        cells = " ".join(f"{row[f'{op}_p50']:>10.3f} / {row[f'{op}_p99']:<9.3f}" for op in OPS)
        print(f"{row['clients']:>7} {row['calls_per_s']:>9.0f} {row['errors']:>6} {cells}")
    print(
        f"split, 1 client, {PROBE_CALLS} calls each: health p50 {probe['Check'][0]:.3f} ms of which the service "
        f"{probe['Check'][1]:.0f} µs; one-sequence Allocate p50 {probe['Allocate'][0]:.3f} ms of which the service "
        f"{probe['Allocate'][1]:.0f} µs (mean, from its histogram); the rest is transport and client"
    )
    one = rows[0]
    worst = rows[-1]
    print(
        f"headline: 1 client alloc1 p50 {one['alloc1_p50']:.3f} ms (target <= 0.8, health baseline "
        f"{one['health_p50']:.3f} ms), extend64 p50 {one['extend64_p50']:.3f} ms (target <= 2); "
        f"{worst['clients']} clients: {worst['calls_per_s']:.0f} calls/s, {worst['errors']} errors"
    )
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
