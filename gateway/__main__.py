"""`python -m kvtier.gateway` (= `kvtier serve`): the OpenAI-compatible HTTP API in front of compute replicas."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import socket
import sys

from kvtier.gateway.config import GatewayConfig, parse_config

# NOTE: the model stack (transformers, and torch under it) loads after the flags are parsed, so
# `--help` and flag errors answer at once.

log = logging.getLogger("kvtier.gateway")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
    # and without it Nagle's algorithm and delayed ACKs add ~40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(cfg: GatewayConfig) -> None:
    import uvicorn

    from kvtier import auth
    from kvtier.api_keys import ApiKeys
    from kvtier.gateway.app import create_app
    from kvtier.gateway.model import load_served_model

    token = auth.load_token(cfg.token_file)
    keys = None
    if cfg.api_keys:  # each caller's key goes to Generate: the node token is not used
        keys = ApiKeys.load(cfg.api_keys, node_token=token)
        token = None
    elif token is None:
        raise ConnectionError(
            f"no token for the compute replicas: set $KVTIER_TOKEN or --token-file (a local stack's is "
            f"{auth.default_token_file()})"
        )
    sock = bind(cfg.host, cfg.port)  # first: a port in use fails before the tokenizer loads
    model = load_served_model(cfg.model, cfg.served_model_name)
    router = metrics = None
    if cfg.nodes_dns is not None or (cfg.nodes is not None and len(cfg.nodes) > 1):
        from kvtier.gateway.metrics import GatewayMetrics
        from kvtier.gateway.router import Router

        node_token = auth.load_token(cfg.token_file)  # the router reads the caches: infrastructure
        if node_token is None:
            raise ConnectionError(
                "routing across nodes reads every cache service's events: the gateway needs the node "
                "token ($KVTIER_TOKEN or --token-file)"
            )
        metrics = GatewayMetrics()
        router = Router(
            cfg.nodes or [],
            node_token,
            model.fingerprint,
            cfg.routing,
            cfg.routing_load_weight,
            metrics,
            dns=cfg.nodes_dns,
            tls_ca=cfg.cache_tls_ca,
        )
        for node in cfg.nodes:
            log.info("node %s: cache %s, replicas %s", node.name, node.cache, " ".join(node.compute))
    app = create_app(
        cfg.compute, model, cfg.api_key, cfg.max_n, token, keys, router, metrics, cfg.tool_call_parser,
        max_body_bytes=cfg.max_body_bytes,
    )  # fmt: skip
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="none",  # the running asyncio loop: grpc.aio's channels live on it
            http="httptools" if _have("httptools") else "h11",  # httptools: a C parser, less CPU per event
            log_level=cfg.log_level.lower(),
            access_log=cfg.access_log,
            timeout_graceful_shutdown=5,
        )
    )
    # Printed at any --log-level: `kvtier up` and the tests read the URL (the port) from it.
    print(
        f"kvtier gateway serving the OpenAI API on {url_of(sock)} (model {model.name}, max_model_len "
        f"{model.max_model_len}, compute replicas ({len(cfg.compute)}): {' '.join(cfg.compute)}; "
        f"{routing_note(cfg, router)}API key "
        f"{'required' if cfg.api_key else 'per tenant' if keys else 'not required'})",
        file=sys.stderr,
        flush=True,
    )
    await server.serve(sockets=[sock])


def routing_note(cfg: GatewayConfig, router) -> str:
    if router is None:
        return ""
    found = f"nodes from DNS {cfg.nodes_dns[0]}" if cfg.nodes_dns else f"{len(router.states)} nodes"
    return f"{found}, {cfg.routing} routing; "


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None, prog: str = "python -m kvtier.gateway") -> int:
    cfg = parse_config(argv, prog)
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    log.info("config: %s", cfg.describe())
    try:
        if cfg.uvloop and _have("uvloop"):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(serve(cfg))
    except (ConnectionError, OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
