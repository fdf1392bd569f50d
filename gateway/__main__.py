"""`python -m gateway` (= `kvtier serve`): the OpenAI-compatible HTTP API in front of compute replicas."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from gateway.config import GatewayConfig, parse_config

# NOTE: the model stack (transformers, and torch under it) loads after the flags are parsed, so
# `--help` and flag errors answer at once.

log = logging.getLogger("kvtier.gateway")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(cfg: GatewayConfig) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.model import load_served_model
    from kvtier import auth

    token = auth.load_token(cfg.token_file)
    if token is None:
        raise ConnectionError(
            f"no token for the compute replicas: set $KVTIER_TOKEN or --token-file (a local stack's is "
            f"{auth.default_token_file()})"
        )
    model = load_served_model(cfg.model, cfg.served_model_name)
    app = create_app(cfg.compute, model, cfg.api_key, cfg.max_n, token)
    sock = bind(cfg.host, cfg.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="none",  # the running asyncio loop: grpc.aio's channels live on it
            log_level=cfg.log_level.lower(),
            access_log=cfg.access_log,
            timeout_graceful_shutdown=5,
        )
    )
    log.info(
        "kvtier gateway serving the OpenAI API on %s (model %s, max_model_len %d, compute replicas (%d): %s; "
        "API key %s)",
        url_of(sock),
        model.name,
        model.max_model_len,
        len(cfg.compute),
        " ".join(cfg.compute),
        "required" if cfg.api_key else "not required",
    )
    await server.serve(sockets=[sock])


def main(argv: list[str] | None = None, prog: str = "python -m gateway") -> int:
    cfg = parse_config(argv, prog)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.info("config: %s", cfg.describe())
    try:
        asyncio.run(serve(cfg))
    except (ConnectionError, OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
