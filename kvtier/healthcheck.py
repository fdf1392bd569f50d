"""Probe a kvtier service's standard gRPC health service; exit 0 when it is SERVING.

    python -m kvtier.healthcheck tcp://localhost:50051
    python -m kvtier.healthcheck unix:///run/kvtier/cache.sock --service kvtier.v1.CacheService

For container health checks (docker compose ``healthcheck``, Kubernetes ``exec`` probes). The
health service needs no token. Exit codes: 0 SERVING, 1 any other status or an RPC error
(printed to stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.auth import grpc_target


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name of ``service`` at ``address`` (``SERVING``, ``NOT_SERVING``, ...).

    Raises:
        grpc.RpcError: the server is unreachable, does not know ``service``, or missed the deadline.
    """
    with grpc.insecure_channel(grpc_target(address)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="unix:///path, tcp://host:port or host:port")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline of the call in seconds")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
