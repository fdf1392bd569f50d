"""`python -m computesvc`: attach to the cache service, load the model, serve Generate."""

from __future__ import annotations

import asyncio
import logging
import sys

from computesvc.config import ComputeConfig, parse_config

# NOTE: the model stack (torch, transformers) is imported after the flags are parsed, so
# `--help` and flag errors answer at once.

log = logging.getLogger("kvtier.compute")


async def serve(cfg: ComputeConfig) -> None:
    from computesvc.replica import Replica
    from computesvc.servicer import ComputeServicer
    from kvtier import auth, telemetry
    from kvtier.api import compute_pb2_grpc
    from kvtier.grpc_server import start_server, wait_for_termination

    telemetry.setup_tracing("kvtier-compute")
    token = auth.load_token(cfg.token_file)
    if token is None:
        raise ConnectionError(
            f"no token for the cache service: set $KVTIER_TOKEN, --token-file, or start the cache service "
            f"first (it writes {auth.default_token_file()})"
        )
    metrics = None
    if cfg.metrics_port is not None:
        from computesvc.metrics import ComputeMetrics
        from kvtier.metrics import start_metrics_server

        metrics = ComputeMetrics()
        port = start_metrics_server(cfg.metrics_port, metrics.registry)
        log.info("Prometheus metrics on http://0.0.0.0:%d/metrics", port)
    replica = Replica(cfg, token, metrics)
    await replica.start()
    servicer = ComputeServicer(replica)
    server, health, address = await start_server(
        "kvtier.v1.ComputeService",
        lambda s: compute_pb2_grpc.add_ComputeServiceServicer_to_server(servicer, s),
        cfg.listen,
        token,
        metrics=metrics,
    )
    log.info(
        "compute replica %s serving on %s (model %s, max %d seqs)",
        cfg.name,
        address,
        cfg.model or "built-in tiny llama",
        cfg.max_num_seqs,
    )
    try:
        await wait_for_termination(server, health)
    finally:
        await replica.stop()
        telemetry.shutdown_tracing()


def main(argv: list[str] | None = None, prog: str = "python -m computesvc") -> int:
    cfg = parse_config(argv, prog)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.info("config: %s", cfg.describe())
    import torch

    from computesvc.replica import IncompatiblePool
    from kvtier.grpc_server import AddressInUse
    from kvtier.pool import PoolUnavailable

    torch.set_num_threads(cfg.threads)
    try:
        asyncio.run(serve(cfg))
    except (
        ConnectionError,
        IncompatiblePool,
        PoolUnavailable,
        ValueError,
        FileNotFoundError,
        AddressInUse,
    ) as e:
        log.error("cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
