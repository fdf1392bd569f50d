"""The per-call guard every kvtier server runs: token check, request decoding and RPC timing,
exercised in-process through `start_server` on a real TCP port."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier.auth import bearer
from kvtier.cachesvc.metrics import CacheMetrics
from kvtier.grpc_server import start_server

TOKEN = "guard-token"
ECHO = "/test.Echo/Echo"


class Echo:
    """A protobuf service registered the way generated code does (registered + generic handlers)."""

    def __init__(self) -> None:
        self.calls = 0

    async def echo(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckRequest:
        self.calls += 1
        if request.service == "crash":
            raise RuntimeError("handler bug")
        return request

    def add_to(self, server) -> None:
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(
                self.echo,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))
        server.add_registered_method_handlers("test.Echo", handlers)


async def serve_and(exercise, metrics: CacheMetrics, echo: Echo) -> None:
    server, _health, address = await start_server(
        "test.Echo", echo.add_to, "127.0.0.1:0", TOKEN, metrics=metrics
    )
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await exercise(channel)
    finally:
        await server.stop(grace=None)


def rpc_count(metrics: CacheMetrics, method: str, code: str) -> float | None:
    return metrics.registry.get_sample_value(
        "kvtier_cache_rpc_duration_seconds_count", {"method": method, "code": code}
    )


def test_health_is_open_and_every_other_service_needs_the_token():
    metrics, echo = CacheMetrics(), Echo()

    async def exercise(channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == 1
        watch = health.Watch(health_pb2.HealthCheckRequest(service="test.Echo"), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING  # context.write path
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as unimplemented:  # a sync generated stub
            await health.List(health_pb2.HealthListRequest(), timeout=10)
        assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED

        echo_call = channel.unary_unary(
            ECHO,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckRequest.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await echo_call(health_pb2.HealthCheckRequest(service="a"), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert denied.value.details() == (
            f"{ECHO}: missing or wrong token; send metadata 'authorization: Bearer <token>' "
            "(the token is in $KVTIER_TOKEN or the service's token file)"
        )
        reply = await echo_call(
            health_pb2.HealthCheckRequest(service="a"), metadata=bearer(TOKEN), timeout=10
        )
        assert reply.service == "a"

        # Reflection answers without the token (`grpcurl list`), under its v1alpha name ...
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        list_services = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in reflect.ServerReflectionInfo(iter([list_services]), timeout=10)]
        names = {s.name for s in replies[0].list_services_response.service}
        assert names == {
            "test.Echo",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        # ... and under v1, the same messages in another package (what current grpcurl asks first).
        reflect_v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        replies = [r async for r in reflect_v1(iter([list_services]), timeout=10)]
        assert {s.name for s in replies[0].list_services_response.service} == names
        # The token check is case-insensitive in its scheme only.
        for scheme in ("bearer", "BEARER"):
            metadata = (("authorization", f"{scheme} {TOKEN}"),)
            reply = await echo_call(health_pb2.HealthCheckRequest(service="b"), metadata=metadata, timeout=10)
            assert reply.service == "b"
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await echo_call(
                health_pb2.HealthCheckRequest(service="c"), metadata=bearer(TOKEN.upper()), timeout=10
            )
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(serve_and(exercise, metrics, echo))
    assert echo.calls == 3  # the refused calls never reached the service
    assert rpc_count(metrics, "Check", "OK") == 1
    assert rpc_count(metrics, "Watch", "CANCELLED") == 1
    assert rpc_count(metrics, "List", "UNIMPLEMENTED") == 1
    assert rpc_count(metrics, "Echo", "UNAUTHENTICATED") == 2
    assert rpc_count(metrics, "Echo", "OK") == 3
    assert rpc_count(metrics, "ServerReflectionInfo", "OK") is None  # client-streaming: not timed


def test_undecodable_bytes_are_invalid_argument_before_service_code_runs():
    metrics, echo = CacheMetrics(), Echo()

    async def exercise(channel: grpc.aio.Channel) -> None:
        raw_echo = channel.unary_unary(ECHO)  # bytes in, bytes out
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await raw_echo(b"\xff\xff\xff", metadata=bearer(TOKEN), timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.value.details().startswith(f"{ECHO}: the request is not a valid message (")
        with pytest.raises(grpc.aio.AioRpcError) as crashed:
            await raw_echo(
                health_pb2.HealthCheckRequest(service="crash").SerializeToString(), metadata=bearer(TOKEN)
            )
        assert crashed.value.code() == grpc.StatusCode.UNKNOWN

    asyncio.run(serve_and(exercise, metrics, echo))
    assert echo.calls == 1  # only the well-formed "crash" request reached the service
    assert rpc_count(metrics, "Echo", "INVALID_ARGUMENT") == 1
    assert rpc_count(metrics, "Echo", "UNKNOWN") == 1
    assert (
        0
        < metrics.registry.get_sample_value(
            "kvtier_cache_rpc_duration_seconds_sum", {"method": "Echo", "code": "INVALID_ARGUMENT"}
        )
        < 1.0
    )
