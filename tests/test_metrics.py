"""Metrics reach a real Prometheus scrape over HTTP with the values the services recorded."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvtier.auth import bearer
from kvtier.cachesvc.metrics import CacheMetrics
from kvtier.cachesvc.node import CacheSnapshot, LeaseSnapshot, TierSnapshot
from kvtier.call_guard import CallGuard
from kvtier.computesvc.metrics import ComputeMetrics
from kvtier.metrics import start_metrics_server


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stats(**overrides: float) -> CacheSnapshot:
    base = dict(
        num_blocks_total=100,
        num_blocks_free=70,
        num_blocks_used=30,
        num_blocks_cached=50,
        usage_percent=30.0,
        prefix_query_tokens=400,
        prefix_hit_tokens=100,
        num_evictions=5,
        num_swap_out_blocks=8,
        num_swap_in_blocks=2,
        num_swap_out_bytes=8 * 4096,
        num_swap_in_bytes=2 * 4096,
        num_host_blocks_total=40,
        num_host_blocks_used=6,
        num_sequences=5,
        num_swapped_sequences=1,
        num_leases=3,
        num_expired_leases=1,
        num_tokens=300,
        num_token_slots=400,
    )
    base.update(overrides)
    num_leases = base.pop("num_leases")
    lease = LeaseSnapshot("0123abcd", "client", 1, 6, 0, 10.0, 60)
    return CacheSnapshot(**base, leases=[lease] * num_leases, block_size=16)


def test_cache_gauges_and_cumulative_counters_scrape_as_stats_say():
    metrics = CacheMetrics()
    port = start_metrics_server(0, metrics.registry, addr="127.0.0.1")
    assert port > 0
    metrics.update(stats())
    # A second snapshot: counters advance by the difference, gauges take the new value.
    metrics.update(
        stats(
            prefix_query_tokens=1000,
            prefix_hit_tokens=750,
            num_evictions=9,
            num_leases=2,
            num_window_released_blocks=3,
        )
    )
    values = scrape(port)

    assert values[("kvtier_cache_capacity_blocks", ())] == 100
    assert values[("kvtier_cache_free_blocks", ())] == 70
    assert values[("kvtier_cache_used_blocks", ())] == 30
    assert values[("kvtier_cache_cached_blocks", ())] == 50
    assert values[("kvtier_cache_block_usage_percent", ())] == 30.0
    assert values[("kvtier_cache_active_leases", ())] == 2
    assert values[("kvtier_cache_prefix_query_tokens_total", ())] == 1000
    assert values[("kvtier_cache_prefix_hit_tokens_total", ())] == 750
    assert values[("kvtier_cache_prefix_hit_ratio", ())] == pytest.approx(0.75)
    assert values[("kvtier_cache_evictions_total", ())] == 9
    assert values[("kvtier_cache_swapped_blocks_total", (("direction", "out"),))] == 8
    assert values[("kvtier_cache_swapped_blocks_total", (("direction", "in"),))] == 2
    assert values[("kvtier_cache_swapped_bytes_total", (("direction", "out"),))] == 8 * 4096
    assert values[("kvtier_cache_swapped_bytes_total", (("direction", "in"),))] == 2 * 4096
    assert values[("kvtier_cache_expired_leases_total", ())] == 1
    assert values[("kvtier_cache_window_released_blocks_total", ())] == 3
    assert values[("kvtier_cache_resident_tokens", ())] == 300
    assert values[("kvtier_cache_slot_waste_ratio", ())] == pytest.approx(0.25)
    assert values[("kvtier_cache_host_capacity_blocks", ())] == 40
    assert values[("kvtier_cache_host_used_blocks", ())] == 6
    assert values[("kvtier_cache_sequences", ())] == 5
    assert values[("kvtier_cache_swapped_sequences", ())] == 1


def test_cache_counter_restarts_from_zero_when_source_resets():
    metrics = CacheMetrics()
    metrics.update(stats(num_evictions=10))
    metrics.update(stats(num_evictions=3))  # the stats source restarted
    assert metrics.registry.get_sample_value("kvtier_cache_evictions_total") == 13


def test_tier_metrics_carry_the_medium_and_advance_by_the_difference():
    metrics = CacheMetrics()
    tiers = [
        TierSnapshot("device", 50, 50 * 4096, 7, 3, 9),
        TierSnapshot("disk", 12, 12 * 4096, 3, 3, 1, 12, 4),
    ]
    metrics.update(stats(tiers=tiers))
    tiers[1].num_hit_blocks, tiers[1].write_queue_depth = 5, 0
    metrics.update(stats(tiers=tiers))
    value = metrics.registry.get_sample_value
    assert value("kvtier_cache_tier_blocks", {"medium": "device"}) == 50
    assert value("kvtier_cache_tier_bytes", {"medium": "disk"}) == 12 * 4096
    assert value("kvtier_cache_tier_hit_blocks_total", {"medium": "disk"}) == 5
    assert value("kvtier_cache_tier_promoted_blocks_total", {"medium": "device"}) == 3
    assert value("kvtier_cache_tier_evicted_blocks_total", {"medium": "device"}) == 9
    assert value("kvtier_cache_tier_stored_blocks_total", {"medium": "disk"}) == 12
    assert value("kvtier_cache_tier_write_queue_depth", {"medium": "disk"}) == 0


def test_two_metric_groups_in_one_process_do_not_clash():
    first, second = CacheMetrics(), CacheMetrics()
    first.update(stats(num_evictions=4))
    assert first.registry.get_sample_value("kvtier_cache_evictions_total") == 4
    assert second.registry.get_sample_value("kvtier_cache_evictions_total") == 0
    ComputeMetrics(), ComputeMetrics()  # constructing twice raises "Duplicated timeseries" if shared


def test_compute_metrics_scrape_with_labels_and_histograms():
    metrics = ComputeMetrics()
    port = start_metrics_server(0, metrics.registry, addr="127.0.0.1")
    metrics.running_sequences.set(4)
    metrics.waiting_sequences.set(1)
    metrics.preemptions.labels("swap").inc()
    metrics.time_to_first_token.observe(0.03)
    for gap in (0.004, 0.004, 0.02):
        metrics.inter_token_latency.observe(gap)
    metrics.generation_tokens.inc(3)
    metrics.prompt_tokens.inc(40)
    metrics.cached_prompt_tokens.inc(32)
    metrics.finished_requests.labels("length").inc()
    metrics.cache_calls.labels("Allocate").inc()
    metrics.decode_steps.inc(3)
    metrics.observe_rpc("Generate", 1.5, "OK")
    values = scrape(port)

    assert values[("kvtier_compute_running_sequences", ())] == 4
    assert values[("kvtier_compute_waiting_sequences", ())] == 1
    assert values[("kvtier_compute_preemptions_total", (("kind", "swap"),))] == 1
    assert values[("kvtier_compute_preemptions_total", (("kind", "recompute"),))] == 0
    assert values[("kvtier_compute_time_to_first_token_seconds_count", ())] == 1
    assert values[("kvtier_compute_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1
    assert values[("kvtier_compute_time_to_first_token_seconds_bucket", (("le", "0.02"),))] == 0
    assert values[("kvtier_compute_inter_token_latency_seconds_bucket", (("le", "0.005"),))] == 2
    assert values[("kvtier_compute_inter_token_latency_seconds_count", ())] == 3
    assert values[("kvtier_compute_generation_tokens_total", ())] == 3
    assert values[("kvtier_compute_prompt_tokens_total", ())] == 40
    assert values[("kvtier_compute_cached_prompt_tokens_total", ())] == 32
    assert values[("kvtier_compute_finished_requests_total", (("finish_reason", "length"),))] == 1
    assert values[("kvtier_compute_cache_calls_total", (("method", "Allocate"),))] == 1
    assert values[("kvtier_compute_decode_steps_total", ())] == 3
    generate = (("code", "OK"), ("method", "Generate"))
    assert values[("kvtier_compute_rpc_duration_seconds_count", generate)] == 1
    assert (
        values[("kvtier_compute_rpc_duration_seconds_bucket", (*generate[:1], ("le", "1.0"), generate[1]))]
        == 0
    )
    assert (
        values[("kvtier_compute_rpc_duration_seconds_bucket", (*generate[:1], ("le", "2.5"), generate[1]))]
        == 1
    )


async def count_up(request: bytes, context) -> AsyncIterator[bytes]:
    """A raw-bytes server-streaming handler written as an async generator (like Generate)."""
    for i in range(int(request)):
        yield str(i).encode()


def test_call_guard_times_each_rpc_with_its_status_code():
    metrics = CacheMetrics()

    async def exercise() -> None:
        server = grpc.aio.server()
        guard = CallGuard(server, "t", metrics)
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, guard)
        guard.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "test.Counter", {"Count": grpc.unary_stream_rpc_method_handler(count_up)}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(2):
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=10)
                assert failed.value.code() == grpc.StatusCode.NOT_FOUND
                # Watch is server-streaming: its first message is the current status.
                watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
                count = channel.unary_stream("/test.Counter/Count")
                replies = [r async for r in count(b"3", metadata=bearer("t"), timeout=10)]
                assert replies == [b"0", b"1", b"2"]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [r async for r in count(b"3", timeout=10)]
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(grace=None)

    asyncio.run(exercise())
    count = metrics.registry.get_sample_value
    assert count("kvtier_cache_rpc_duration_seconds_count", {"method": "Check", "code": "OK"}) == 2
    assert count("kvtier_cache_rpc_duration_seconds_count", {"method": "Check", "code": "NOT_FOUND"}) == 1
    assert count("kvtier_cache_rpc_duration_seconds_count", {"method": "Watch", "code": "CANCELLED"}) == 1
    assert count("kvtier_cache_rpc_duration_seconds_count", {"method": "Count", "code": "OK"}) == 1
    assert (
        count("kvtier_cache_rpc_duration_seconds_count", {"method": "Count", "code": "UNAUTHENTICATED"}) == 1
    )
    assert count("kvtier_cache_rpc_duration_seconds_sum", {"method": "Check", "code": "OK"}) < 1.0


def test_no_service_exposes_created_series():
    """Counters and histograms export no ``_created`` sample (vLLM turns them off): every
    service's registry, scraped as Prometheus would, after each kind of metric moved."""
    from kvtier.gateway.metrics import GatewayMetrics

    cache, compute, gateway = CacheMetrics(), ComputeMetrics(), GatewayMetrics()
    cache.update(stats())
    compute.time_to_first_token.observe(0.03)
    compute.observe_rpc("Generate", 1.5, "OK")
    gateway.requests.labels("/v1/completions", "200").inc()
    for metrics in (cache, compute, gateway):
        port = start_metrics_server(0, metrics.registry, addr="127.0.0.1")
        created = [name for name, _ in scrape(port) if name.endswith("_created")]
        assert created == [], created
