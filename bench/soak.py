"""Soak: load mixed with injected faults, then an account of what leaked.

The local stack runs (cache service + 2 compute replicas, real processes on Unix sockets).
`--clients` spawned processes (tests/clients/generate_load.py, no torch) send greedy Generate
requests through ComputeClient (failover across replicas) for the whole run. The run has two
phases:

1. baseline (the first ~20%): load only;
2. faults: every `--fault-every` seconds a compute replica is SIGKILLed and restarted
   (alternating replicas), and at the start of the phase a client attaches directly to the
   cache service, takes blocks and stops heartbeating (its lease must expire and its later
   calls get NOT_FOUND).

A thread reads GetStats every 0.25 s and counts invariant violations (free + used + fenced !=
total, used or host used out of range, per-lease sequences not adding up). At the end, once every
client is done and the dead replicas' leases have expired, every block still referenced is a
leaked block. Failed requests are those that ended in any status other than RESOURCE_EXHAUSTED
despite failover.

    python bench/soak.py                 # ~2 minutes
    python bench/soak.py --quick         # 30 s
    python bench/soak.py --seconds 600   # longer

The last line is the headline; the exit status is 1 if anything leaked, broke or failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the load client lives with the tests that also use it

from clients.generate_load import LoadSpec, collect, start_clients  # noqa: E402

from kvtier.cache_client import CacheClient  # noqa: E402
from kvtier.cache_errors import CacheCallError  # noqa: E402
from kvtier.cli.stack import LocalStack, wait_serving  # noqa: E402

POOL = ["--num-blocks", "192", "--swap-space", "0.01"]


class InvariantWatch:
    """GetStats every `period_s` from a thread; counts samples and invariant violations."""

    def __init__(self, address: str, token: str, period_s: float = 0.25):
        self.address, self.token, self.period_s = address, token, period_s
        self.samples = 0
        self.unreachable = 0  # samples that found no cache service (never expected here)
        self.violations: list[str] = []
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariant-watch", daemon=True)

    def _run(self) -> None:
        client = CacheClient.connect(self.address, self.token, timeout_s=5.0)
        while not self._stop.wait(self.period_s):
            try:
                s = client.get_stats()
            except CacheCallError:
                self.unreachable += 1
                continue
            self.samples += 1
            self.peak_used = max(self.peak_used, s.num_blocks_used)
            if not blocks_add_up(s):
                self.violations.append(
                    f"free {s.num_blocks_free} + used {s.num_blocks_used} + fenced {s.num_blocks_fenced} "
                    f"!= {s.num_blocks_total}"
                )
            if not 0 <= s.num_blocks_used <= s.num_blocks_total:
                self.violations.append(f"used {s.num_blocks_used} outside [0, {s.num_blocks_total}]")
            if not 0 <= s.num_host_blocks_used <= s.num_host_blocks_total:
                self.violations.append(f"host used {s.num_host_blocks_used} of {s.num_host_blocks_total}")
            if sum(lease.num_sequences for lease in s.leases) != s.num_sequences:
                self.violations.append("per-lease sequences do not add up to num_sequences")
        client.close()

    def start(self) -> InvariantWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def blocks_add_up(s) -> bool:
    """free + used + fenced = total (a SIGKILLed writer's open blocks are fenced, neither free nor
    used, for --fence-hold-s)."""
    return s.num_blocks_free + s.num_blocks_used + s.num_blocks_fenced == s.num_blocks_total


class SilentClient:
    """Attaches, takes blocks (committed and not), then never heartbeats again."""

    def __init__(self, address: str, token: str):
        self.client = CacheClient.connect(address, token, timeout_s=5.0)
        self.client.attach("silent-client")
        prompts = [[(7 * k + i) % 256 for i in range(40)] for k in range(4)]
        seqs = self.client.allocate(prompts)
        self.client.commit([(s.sequence_id, [], 40) for s in seqs[:2]])
        self.sequence_ids = [s.sequence_id for s in seqs]
        self.num_blocks = sum(len(s.block_table) for s in seqs)

    def refused_as_expired(self) -> bool:
        """True once every call of the lease is refused with NOT_FOUND naming it."""
        try:
            self.client.free(self.sequence_ids)
        except CacheCallError as e:
            return e.code == "NOT_FOUND" and self.client.lease_id[:8] in e.details
        return False

    def close(self) -> None:
        self.client.close()


def restart(stack: LocalStack, i: int, tag: str) -> None:
    """Start replica i again, keeping the old one's log (a restart writes a fresh one)."""
    old = stack.replicas[i]
    old.log_path.rename(old.log_path.with_suffix(f".{tag}.log"))
    stack.replicas[i] = stack.start_replica(i)
    wait_serving(stack.replicas[i])


def restart_dead_replicas(stack: LocalStack, t0: float) -> list[str]:
    """Replicas that exited on their own since the last look (each one is a finding), restarted."""
    found = []
    for i, replica in enumerate(stack.replicas):
        if not replica.alive():
            code = replica.proc.returncode
            found.append(f"compute-{i} exited on its own at t<={time.monotonic() - t0:.0f}s (exit {code})")
            print(f"soak: {found[-1]}; restarting it", flush=True)
            restart(stack, i, f"died-{code}")
    return found


def wait_until(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling a state change with a deadline
    return predicate()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="length of the run (load time), seconds")
    p.add_argument("--quick", action="store_true", help="a 30 s run (overrides --seconds)")
    p.add_argument("--clients", type=int, default=16, help="load client processes")
    p.add_argument("--fault-every", type=float, help="seconds between replica kills (default: seconds / 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="the cache service's lease TTL, seconds (its default; 2 makes live replicas on a starved "
        "machine lose their leases too)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 30.0
    if args.fault_every is None:
        args.fault_every = max(5.0, args.seconds / 8)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    token = secrets.token_urlsafe(24)
    run_dir = Path(tempfile.mkdtemp(prefix="kvtier-soak-")) / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVTIER_"))}
    env["KVTIER_TOKEN"] = token
    stack = LocalStack(
        run_dir, cache_args=[*POOL, "--lease-ttl", str(args.lease_ttl)], num_replicas=2, env=env
    )
    print(f"soak: starting the stack in {run_dir} ...", flush=True)
    stack.up()
    faults: Counter[str] = Counter()
    unexpected: list[str] = []  # replicas that exited without being killed
    try:
        spec = LoadSpec(stack.compute_addresses, token, args.seconds, max_tokens=args.max_tokens)
        ctx = multiprocessing.get_context("spawn")
        print(f"soak: spawning {args.clients} load clients ...", flush=True)
        procs, go, results = start_clients(ctx, spec, args.clients)
        watch = InvariantWatch(stack.cache_address, token).start()
        go.set()
        t0 = time.monotonic()
        baseline_end = t0 + max(5.0, 0.2 * args.seconds)
        end = t0 + args.seconds
        print(
            f"soak: baseline (no faults) for {baseline_end - t0:.0f}s, then faults until {args.seconds:.0f}s"
        )
        time.sleep(max(0.0, baseline_end - time.monotonic()))  # the baseline phase runs undisturbed

        silent = SilentClient(stack.cache_address, token)
        faults["silent client"] += 1
        print(
            f"soak: t={time.monotonic() - t0:5.1f}s a client took {silent.num_blocks} blocks and went silent"
        )
        unexpected += kill_replicas_until(stack, end, args.fault_every, t0, faults)
        out = collect(procs, results, max(0.0, end - time.monotonic()) + 2 * spec.request_timeout_s)
        unexpected += restart_dead_replicas(stack, t0)
        stats = settled_stats(stack.cache_address, token, args.lease_ttl)
        watch.stop()
        silent_expired = silent.refused_as_expired()
        silent.close()
    finally:
        stack.down()

    violations = list(watch.violations) + unexpected
    if not silent_expired:
        violations.append("the silent client's lease did not expire with NOT_FOUND naming it")
    if not blocks_add_up(stats):
        violations.append("final stats: free + used + fenced != total")
    return report(args, out, stats, watch, violations, faults, run_dir, (t0, baseline_end, end))


def kill_replicas_until(
    stack: LocalStack, end: float, fault_every: float, t0: float, faults: Counter
) -> list[str]:
    """SIGKILL the two replicas in turn, every fault_every seconds until 2 s before end (monotonic
    seconds), restarting each at once; the replicas that had died unkilled meanwhile."""
    unexpected: list[str] = []
    victim = 0
    next_fault = time.monotonic()
    while next_fault + 2.0 < end:
        time.sleep(max(0.0, next_fault - time.monotonic()))
        unexpected += restart_dead_replicas(stack, t0)
        replica = stack.replicas[victim]
        replica.stop(signal.SIGKILL)
        faults["replica SIGKILL"] += 1
        killed_at = time.monotonic()
        restart(stack, victim, f"killed-{faults['replica SIGKILL']}")
        print(
            f"soak: t={killed_at - t0:5.1f}s SIGKILLed compute-{victim}; serving again after "
            f"{time.monotonic() - killed_at:.1f}s",
            flush=True,
        )
        victim = 1 - victim
        next_fault = max(time.monotonic(), killed_at + fault_every)
    return unexpected


def settled_stats(cache_address: str, token: str, lease_ttl: float):
    """GetStats once the pool is empty, or after two lease TTLs (+5 s) if it never empties.

    Nothing runs now: the dead replicas' and the silent client's leases expire, and every block
    still referenced after that is leaked."""
    probe = CacheClient.connect(cache_address, token, timeout_s=5.0)
    try:
        return (
            wait_until(
                lambda: (s := probe.get_stats()).num_blocks_used == 0 and s.num_sequences == 0 and s,
                2 * lease_ttl + 5.0,
            )
            or probe.get_stats()
        )
    finally:
        probe.close()


def report(
    args: argparse.Namespace,
    out: list[dict],
    stats,
    watch: InvariantWatch,
    violations: list[str],
    faults: Counter[str],
    run_dir: Path,
    phases: tuple[float, float, float],
) -> int:
    """Print the figures, the last line the headline; the exit status (0: all served, none failed
    or leaked, no violation). phases: (start, end of the fault-free baseline, end), monotonic s."""
    t0, baseline_end, end = phases
    served = sum(r["served"] for r in out)
    errors: Counter[str] = Counter()
    for r in out:
        errors.update(r["errors"])
    failed = sum(n for code, n in errors.items() if code != "RESOURCE_EXHAUSTED")
    done_at = sorted(t for r in out for t in r["done_at"])
    base = sum(1 for t in done_at if t < baseline_end) / (baseline_end - t0)
    under = sum(1 for t in done_at if t >= baseline_end) / max(1e-9, end - baseline_end)
    leaked = stats.num_blocks_used

    first_errors = [r["first_error"] for r in out if r["first_error"]][:2]
    print(
        f"soak: {args.clients} clients, {args.seconds:.0f}s, pool {stats.num_blocks_total} blocks "
        f"(peak used {watch.peak_used})"
    )
    print(f"soak: errors by status {dict(errors) or '{}'}; first: {first_errors}")
    print(f"soak: {watch.samples} invariant checks ({watch.unreachable} found no cache service)")
    print(f"soak: faults {dict(faults)}; {stats.num_expired_leases} leases expired; logs in {run_dir}")
    if base:
        print(
            f"soak: throughput baseline (no faults) {base:.1f} req/s; under faults {under:.1f} req/s "
            f"({100 * under / base:.0f}% of baseline)"
        )
    for v in violations[:5]:
        print(f"soak: violation: {v}")
    print(
        f"soak: {served} requests served, {failed} failed, {sum(faults.values())} faults injected, "
        f"{leaked} blocks leaked, {len(violations)} invariant violations"
    )
    return 0 if served and not failed and not leaked and not violations else 1


if __name__ == "__main__":
    sys.exit(main())
