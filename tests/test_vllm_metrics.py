"""The metrics in the ecosystem's conventions (issue 12.1), scraped over HTTP from real services.

A cache service and one compute replica, both with `--vllm-metrics`, are scraped before any
traffic (labelled counters at 0, `process_*`, the config info), after a workload through the
replica (every vLLM series a dashboard reads, with values that agree with what the requests
got back), and while a probe lease holds and swaps a sequence (KV usage, swap counters). The
Grafana dashboard in deploy/grafana/ may only query series the services export.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from servers import REPO, TOKEN, local_stack, wait_until

from kvtier.cache_client import CacheClient
from kvtier.cachesvc.metrics import CacheMetrics
from kvtier.compute_client import ComputeClient
from kvtier.computesvc.metrics import ComputeMetrics
from kvtier.metrics import TINY_MODEL_NAME, metrics_host, serve_metrics

URL = re.compile(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics \(also under vllm: names\)")
MODEL = (("model_name", TINY_MODEL_NAME),)
PROMPT = list(range(1, 41))  # 40 tokens, block size 16: a repeat of it hits 32
MAX_TOKENS = (6, 4, 5)
DASHBOARD = REPO / "deploy" / "grafana" / "kvtier.json"


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape_text(port))
        for s in family.samples
    }


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on `port`, from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


# promtool's lint reserves ':' for recording rules, and says so of every vllm: name (vLLM's own
# /metrics draws the same lines); those names are the point of --vllm-metrics.
COLON_LINT = "metric names should not contain ':'"


def promtool_check(text: str) -> None:
    """`promtool check metrics` parses the scrape and finds nothing to lint but the vllm: names'
    colons, where the binary exists."""
    # On PATH, or beside the venv's python (.ci/run unpacks Debian's promtool there).
    promtool = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    if promtool is None:
        print("promtool not installed: `promtool check metrics` skipped")
        return
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and not (line.startswith("vllm:") and line.endswith(COLON_LINT))
    ]
    assert done.returncode in (0, 3) and not problems, done.stdout + done.stderr  # 3: lint findings


def test_metrics_host_follows_the_service_address():
    assert metrics_host("unix:///run/kvtier/cache.sock") == "127.0.0.1"
    assert metrics_host("tcp://127.0.0.1:50051") == "127.0.0.1"
    assert metrics_host("tcp://localhost:50051") == "127.0.0.1"
    assert metrics_host("tcp://0.0.0.0:50051") == "0.0.0.0"
    assert metrics_host("tcp://[::1]:50051") == "::1"
    assert metrics_host("tcp://10.1.2.3:50051") == "10.1.2.3"


@pytest.mark.parametrize(
    ("model", "model_name", "label"),
    [
        (None, None, TINY_MODEL_NAME),
        ("/models/Llama-3-8B/", None, "Llama-3-8B"),
        ("/models/x", "llama3", "llama3"),
    ],
)
def test_serve_metrics_labels_the_model_and_binds_the_service_host(model, model_name, label):
    cfg = SimpleNamespace(
        listen="unix:///run/kvtier/compute-0.sock",
        model=model,
        metrics_port=0,
        metrics_host=None,
        metrics_model_name=model_name,
        vllm_metrics=True,
    )
    port = serve_metrics(ComputeMetrics(), cfg, logging.getLogger("test"))
    assert listening_addresses(port) == {"127.0.0.1"}
    samples = scrape(port)
    assert samples[("vllm:num_requests_running", (("model_name", label),))] == 0
    assert samples[("kvtier_compute_running_sequences", ())] == 0


def test_vllm_series_before_and_after_a_workload(tmp_path):
    cache_args = ["--num-blocks", "64", "--swap-space", "0.001", "--metrics-port", "0", "--vllm-metrics"]
    compute_args = ["--metrics-port", "0", "--vllm-metrics"]
    with local_stack(tmp_path / "run", cache_args, compute_args, replicas=1) as stack:
        cache_port = int(URL.search(stack.cache.log()).group(1))
        compute_port = int(URL.search(stack.replicas[0].log()).group(1))
        # Bound to loopback (the services listen on Unix sockets), not to every interface.
        assert listening_addresses(cache_port) == {"127.0.0.1"}
        assert listening_addresses(compute_port) == {"127.0.0.1"}

        # ---- before any traffic: the series exist, counters at 0
        cache0, compute0 = scrape(cache_port), scrape(compute_port)
        for series in (
            ("kvtier_cache_swapped_blocks_total", (("direction", "out"),)),
            ("kvtier_cache_swapped_blocks_total", (("direction", "in"),)),
            ("kvtier_cache_swapped_bytes_total", (("direction", "out"),)),
            ("kvtier_cache_evictions_total", ()),
            ("kvtier_cache_prefix_query_tokens_total", ()),
            ("kvtier_cache_rpc_duration_seconds_count", (("code", "OK"), ("method", "Allocate"))),
        ):
            assert cache0[series] == 0, series
        for series in (
            ("kvtier_compute_preemptions_total", (("kind", "swap"),)),
            ("kvtier_compute_preemptions_total", (("kind", "recompute"),)),
            ("kvtier_compute_cache_calls_total", (("method", "swap_out"),)),
            ("kvtier_compute_finished_requests_total", (("finish_reason", "stop"),)),
            ("kvtier_compute_rpc_duration_seconds_count", (("code", "OK"), ("method", "Generate"))),
            ("vllm:prefix_cache_queries_total", MODEL),
            ("vllm:prefix_cache_hits_total", MODEL),
            ("vllm:prompt_tokens_total", MODEL),
            ("vllm:generation_tokens_total", MODEL),
            ("vllm:num_preemptions_total", (("kind", "swap"), *MODEL)),
            ("vllm:num_requests_running", MODEL),
            ("vllm:num_requests_waiting", MODEL),
            ("vllm:time_to_first_token_seconds_count", MODEL),
            ("vllm:e2e_request_latency_seconds_count", MODEL),
        ):
            assert compute0[series] == 0, series
        assert cache0[("vllm:kv_cache_usage_perc", MODEL)] == 0
        [(info, value)] = [(dict(lb), v) for (n, lb), v in cache0.items() if n == "vllm:cache_config_info"]
        assert value == 1 and info["model_name"] == TINY_MODEL_NAME
        assert (
            info["block_size"] == "16" and info["num_gpu_blocks"] == "64" and info["cache_dtype"] == "float32"
        )
        assert int(info["num_cpu_blocks"]) > 0
        for samples in (cache0, compute0):
            assert samples[("process_resident_memory_bytes", ())] > 0
            assert samples[("process_cpu_seconds_total", ())] > 0
            # No counter or histogram exports a _created sample (vLLM turns them off): noise.
            assert not [name for name, _ in samples if name.endswith("_created")]

        # ---- a workload: three greedy requests of one prompt, the last two hit its blocks
        async def workload():
            client = ComputeClient(stack.compute_addresses, TOKEN)
            done = []
            for n in MAX_TOKENS:
                request = client.request(
                    prompt_token_ids=PROMPT, max_tokens=n, temperature=0, ignore_eos=True
                )
                done.append(await client.complete(request))
            await client.close()
            return done

        done = asyncio.run(workload())
        assert [d.cached_prompt_tokens for d in done] == [0, 32, 32]
        queries, hits = len(PROMPT) * len(MAX_TOKENS), sum(d.cached_prompt_tokens for d in done)
        generated = sum(MAX_TOKENS)
        # The replica sets its gauges at the end of the step that released the last request, the
        # cache service its counters once a second: poll both, with a deadline.
        finished = ("kvtier_compute_e2e_request_latency_seconds_count", ())
        running = ("kvtier_compute_running_sequences", ())

        def compute_settled():
            s = scrape(compute_port)
            return s[finished] == len(MAX_TOKENS) and s[running] == 0 and s

        compute = wait_until(compute_settled, 10, "Generate counted and the batch empty")
        cache = wait_until(
            lambda: (
                (s := scrape(cache_port))[("kvtier_cache_prefix_query_tokens_total", ())] >= queries and s
            ),
            10,
            "cache counters refreshed",
        )

        def v(name, labels=()):
            return compute[(name, tuple(sorted((*labels, *MODEL))))]

        served = len(MAX_TOKENS)
        assert v("vllm:prefix_cache_queries_total") == queries
        assert v("vllm:prefix_cache_hits_total") == hits <= queries
        assert v("vllm:prompt_tokens_total") == queries
        assert v("vllm:generation_tokens_total") == generated
        assert v("vllm:request_success_total", [("finished_reason", "length")]) == served
        assert v("vllm:num_requests_running") == 0 and v("vllm:num_requests_waiting") == 0
        for histogram in (
            "vllm:time_to_first_token_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds",
            "vllm:request_inference_time_seconds",
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
        ):
            assert v(f"{histogram}_count") == served, histogram
            assert v(f"{histogram}_bucket", [("le", "+Inf")]) == served, histogram
        assert v("vllm:inter_token_latency_seconds_count") == generated - served
        assert v("vllm:time_per_output_token_seconds_count") == generated - served
        assert v("vllm:request_prompt_tokens_sum") == queries
        assert v("vllm:request_generation_tokens_sum") == generated
        # The phases of a request fit in its end-to-end time; the clock only moves forward.
        e2e = v("vllm:e2e_request_latency_seconds_sum")
        phases = [v(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode")]
        assert all(p >= 0 for p in phases) and sum(phases) <= e2e
        assert v("vllm:time_to_first_token_seconds_sum") <= e2e
        # The vllm: series are the kvtier_ ones under another name.
        assert compute[("kvtier_compute_time_to_first_token_seconds_count", ())] == served
        assert compute[("kvtier_compute_e2e_request_latency_seconds_count", ())] == served
        assert compute[("kvtier_compute_cached_prompt_tokens_total", ())] == hits
        # The pool's own view: one replica, so its lookups are the replica's.
        assert cache[("kvtier_cache_prefix_query_tokens_total", ())] == queries
        assert cache[("kvtier_cache_prefix_hit_tokens_total", ())] == hits
        promtool_check(scrape_text(compute_port))
        promtool_check(scrape_text(cache_port))

        # ---- a probe lease holds a sequence, then swaps it out: usage and swap counters move
        probe = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=5.0)
        try:
            probe.attach("metrics-probe")
            [seq] = probe.allocate([list(range(100, 164))])  # 64 tokens: 4 blocks + lookahead

            def usage_seen():
                probe.heartbeat()
                s = scrape(cache_port)
                return s[("kvtier_cache_used_blocks", ())] > 0 and s

            held = wait_until(usage_seen, 10, "used blocks in the metrics")
            used, capacity = (
                held[("kvtier_cache_used_blocks", ())],
                held[("kvtier_cache_capacity_blocks", ())],
            )
            assert capacity == 64 and used == len(seq.block_table)
            assert held[("vllm:kv_cache_usage_perc", MODEL)] == pytest.approx(used / capacity)
            assert 0 < held[("kvtier_cache_kv_usage_ratio", ())] <= 1
            moved = probe.swap_out([seq.sequence_id]).num_blocks

            def swap_seen():
                probe.heartbeat()
                s = scrape(cache_port)
                return s[("kvtier_cache_swapped_blocks_total", (("direction", "out"),))] > 0 and s

            swapped = wait_until(swap_seen, 10, "swap counted in the metrics")
            assert swapped[("kvtier_cache_swapped_blocks_total", (("direction", "out"),))] == moved > 0
            assert swapped[("kvtier_cache_swapped_blocks_total", (("direction", "in"),))] == 0
            assert swapped[("vllm:kv_cache_usage_perc", MODEL)] == 0
            probe.free([seq.sequence_id])
        finally:
            probe.close()


def exported_series() -> set[str]:
    """Every sample name the cache and compute services export with --vllm-metrics, from the
    metric classes they serve (the scrape test checks those reach HTTP)."""
    cache, compute = CacheMetrics(), ComputeMetrics()
    cache.describe_pool(16, 64, 8, "float32", 8 * 4096, "cpu-shm")
    cache.registry.register(cache.vllm_aliases(TINY_MODEL_NAME))
    compute.registry.register(compute.vllm_aliases(TINY_MODEL_NAME))
    cache.tenant_blocks.labels("")  # labelled by tenant: present once a tenant holds blocks
    cache.tenant_quota_blocks.labels("")
    return {
        s.name
        for metrics in (cache, compute)
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }


def test_grafana_dashboard_queries_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(exprs) >= 10
    exported = exported_series()
    name = re.compile(r"\b(?:kvtier_|vllm:|process_)[A-Za-z0-9_:]*")
    referenced = set()
    for expr in exprs:
        names = set(name.findall(expr))
        assert names, f"no kvtier/vllm/process series in {expr!r}"
        referenced |= names
    assert referenced - exported == set()
    # It reads the kvtier_ names (exported with or without --vllm-metrics): the headline ones.
    for series in (
        "kvtier_cache_kv_usage_ratio",
        "kvtier_compute_running_sequences",
        "kvtier_compute_waiting_sequences",
        "kvtier_compute_cached_prompt_tokens_total",
        "kvtier_compute_time_to_first_token_seconds_bucket",
        "kvtier_compute_e2e_request_latency_seconds_bucket",
        "process_resident_memory_bytes",
    ):
        assert series in referenced, series
