"""`python -m kvtier.computesvc`: attach to the cache service, load the model, serve Generate."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from kvtier.computesvc.config import ComputeConfig, parse_config
from kvtier.cpu_plan import loaded_allocators, usable_cpus

# NOTE: the model stack (torch, transformers) is imported after the flags are parsed, so
# `--help` and flag errors answer at once.

log = logging.getLogger("kvtier.compute")

GENERATE = "/kvtier.v1.ComputeService/Generate"
# Generate's fields beside the prompt: at most 16 stop strings of 256 characters (4 bytes each
# in UTF-8), 256 stop token ids, the scalar sampling fields, cache_salt and request_id (256
# bytes each), with their tags and lengths: about 20 KiB, rounded up.
GENERATE_FIELDS_BYTES = 64 << 10
TOKEN_ID_BYTES = 10  # an int64 varint at its longest (a negative id: refused after parsing)


def generate_request_limit(cfg: ComputeConfig, max_prompt_bytes: int, max_model_len: int) -> int:
    """Largest Generate request in bytes (--max-request-bytes, else the largest legitimate one:
    a text prompt at its byte limit, prompt and resume token ids filling the context, the other
    fields at their limits). The CallGuard refuses a larger one before it is parsed."""
    if cfg.max_request_bytes:
        return cfg.max_request_bytes
    return max_prompt_bytes + TOKEN_ID_BYTES * max_model_len + GENERATE_FIELDS_BYTES


def load_credentials(cfg: ComputeConfig) -> tuple[str, dict | None]:
    """The node token, and Generate's credential when --api-keys is given (None: the node token).

    Read before the model stack is imported: a missing token or a bad keys file fails at once.
    """
    from kvtier import auth
    from kvtier.api_keys import ApiKeys, ClientKeys

    token = auth.load_token(cfg.token_file)
    if token is None:
        raise ConnectionError(
            f"no token for the cache service: set $KVTIER_TOKEN, --token-file, or start the cache service "
            f"first (it writes {auth.default_token_file()})"
        )
    if not cfg.api_keys:
        return token, None
    keys = ApiKeys.load(cfg.api_keys, node_token=token)
    log.info(
        "Generate takes client API keys of %d tenants%s",
        len(keys.tenants),
        " (and the node token)" if cfg.allow_node_token else "",
    )
    return token, {GENERATE: ClientKeys(keys, node_token=token if cfg.allow_node_token else None)}


async def serve(cfg: ComputeConfig, token: str, credentials: dict | None = None) -> None:
    from kvtier import telemetry
    from kvtier.api import compute_pb2_grpc
    from kvtier.computesvc.replica import Replica
    from kvtier.computesvc.servicer import ComputeServicer
    from kvtier.grpc_server import start_server, wait_for_termination

    telemetry.setup_tracing("kvtier-compute")
    metrics = None
    if cfg.metrics_port is not None:
        from kvtier.computesvc.metrics import ComputeMetrics
        from kvtier.metrics import serve_metrics

        metrics = ComputeMetrics()
        serve_metrics(metrics, cfg, log)
    replica = Replica(cfg, token, metrics)
    await replica.start()
    servicer = ComputeServicer(replica)
    limit = generate_request_limit(cfg, servicer.max_prompt_bytes, replica.shape.max_model_len)
    log.info("Generate requests over %d bytes are refused before they are parsed", limit)
    server, health, address = await start_server(
        "kvtier.v1.ComputeService",
        lambda s: compute_pb2_grpc.add_ComputeServiceServicer_to_server(servicer, s),
        cfg.listen,
        token,
        metrics=metrics,
        credentials=credentials,
        max_request_bytes={GENERATE: limit},
    )
    report_attachment(replica, health)
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


def report_attachment(replica, health) -> None:
    """Health says NOT_SERVING while the replica has lost its cache service, SERVING once it is
    attached again: a load balancer or `kvtier.healthcheck` then routes around a replica that
    could only fail requests."""
    from grpc_health.v1 import health_pb2

    def report(attached: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if attached else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("kvtier.v1.ComputeService", ""):
            asyncio.ensure_future(health.set(service, status))
        log.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    replica.on_attached_change = report
    if not replica.connected.is_set():  # lost between attaching and serving
        report(False)


def main(argv: list[str] | None = None, prog: str = "python -m kvtier.computesvc") -> int:
    cfg = parse_config(argv, prog)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.info("config: %s", cfg.describe())
    try:
        token, credentials = load_credentials(cfg)
    except (ConnectionError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 2
    import torch

    from kvtier.computesvc.replica import IncompatiblePool
    from kvtier.grpc_server import AddressInUse
    from kvtier.pool import PoolUnavailable

    torch.set_num_threads(cfg.threads)
    log.info(
        "CPU: %d torch thread(s) of %d usable CPUs, allocator %s%s",
        torch.get_num_threads(),
        usable_cpus(),
        loaded_allocators(),
        "" if "tcmalloc" in loaded_allocators() else " (`kvtier up` preloads tcmalloc where installed)",
    )
    try:
        asyncio.run(serve(cfg, token, credentials))
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


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: by the time ``main`` returns, the server, the
    replica (lease, heartbeat, pool mapping) and tracing are stopped, so all that teardown would
    do is finalize torch's and transformers' modules, which takes over a second here (every
    restart and rolling update waits for it) and writes nothing anyone reads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
