"""The gateway's configuration: flags and environment, one dataclass."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.gateway.discovery import Node, NodeFileError, load_node_file, parse_dns_flag, parse_node_flag

TINY_MODEL_NAME = "kvtier-tiny"


@dataclass
class GatewayConfig:
    host: str
    port: int
    compute: list[str]
    api_key: str | None
    api_keys: str | None
    served_model_name: str
    model: str | None
    token_file: str | None
    max_n: int
    access_log: bool
    uvloop: bool
    log_level: str
    # Several nodes (cache service + its replicas) behind the KV-aware router; None = one pool.
    nodes: list[Node] | None = None
    nodes_dns: tuple[str, str] | None = None  # (cache, compute) headless Services, resolved by the router
    routing: str = "kv-aware"
    routing_load_weight: float = 1.0
    cache_tls_ca: str | None = None  # PEM CA bundle: the router reaches cache services over TLS
    tool_call_parser: str = "hermes"  # gateway.tools.PARSERS: tool calls in the output (tool_choice auto)
    max_body_bytes: int | None = None  # None: from the model's context (gateway.limits.max_body_bytes)

    def describe(self) -> str:
        """One line for the log; the API key is never printed."""
        fields = asdict(self) | {"api_key": "set" if self.api_key else "none"}
        return " ".join(f"{k}={v}" for k, v in fields.items())


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds `(default: X)` only where the help does not say the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # A flag without a value (store_true/store_false) says what it does: "(default: True)" on
        # --no-uvloop read as if the flag were on by default.
        if (
            action.default in (None, False, argparse.SUPPRESS)
            or action.nargs == 0
            or "default" in (action.help or "")
        ):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser(prog: str = "python -m kvtier.gateway") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "kvtier gateway: an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health, /metrics, /version) in front of kvtier compute replicas. Each "
            "completion is one Generate stream to a replica, failing over to the next one."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on for HTTP (0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port; the log says which)")
    p.add_argument(
        "--compute",
        nargs="+",
        metavar="ADDR",
        help="compute replica addresses (unix:///path or host:port); default: the replicas of the "
        "local stack `kvtier up` runs in the run directory ($KVTIER_RUN_DIR)",
    )
    nodes = p.add_argument_group(
        "nodes and routing",
        "Several nodes (a node is one cache service, one accelerator, and the compute replicas "
        "attached to it): the gateway routes each request to one node's replicas. The KV-aware "
        "router follows every cache service's block events (WatchEventBatches) and sends a request where "
        "its prefix is cached, weighed against load. It reads the caches with the node token.",
    )
    nodes.add_argument(
        "--node",
        action="append",
        metavar="[NAME@]CACHE=COMPUTE[,COMPUTE...]",
        help="one node: its cache service address and its replicas' addresses (repeat per node)",
    )
    nodes.add_argument(
        "--node-file",
        metavar="FILE",
        help='nodes from a JSON file: {"nodes": [{"name": "gpu0", "cache": ADDR, "compute": [ADDR, ...]}]}',
    )
    nodes.add_argument(
        "--nodes-dns",
        metavar="CACHE_HOST:PORT,COMPUTE_HOST:PORT",
        help="nodes from Kubernetes DNS: every address of the headless cache Service is a node, every "
        "address of the headless compute Service a replica; a replica belongs to the node whose cache "
        "lists it among its leases (compute runs with --name POD_IP:PORT)",
    )
    nodes.add_argument(
        "--routing",
        choices=["kv-aware", "round-robin", "random"],
        default="kv-aware",
        help="how a request's node is chosen (with more than one node)",
    )
    nodes.add_argument(
        "--routing-load-weight",
        type=float,
        default=1.0,
        help="kv-aware: score = prefill seconds a node's cached prefix saves - this x the seconds of "
        "work queued on it (its measured throughput); higher spreads a popular prefix sooner, 0 "
        "routes by prefix alone",
    )
    nodes.add_argument(
        "--cache-tls-ca",
        metavar="PEM",
        help="CA bundle: the router reaches the cache services over TLS (as compute's --tls-ca)",
    )
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer <key>` on /v1 requests (default: $KVTIER_API_KEY; none = no auth)",
    )
    p.add_argument(
        "--api-keys",
        metavar="FILE",
        help="client API keys per tenant (JSON; format: kvtier/api_keys.py), the replicas' --api-keys "
        "file: a /v1 request needs one of them, and its key is what the gateway sends to Generate "
        "(the replica charges that key's tenant); no node token is needed then",
    )
    p.add_argument(
        "--served-model-name",
        help=f"the model name clients send and /v1/models lists (default: the --model directory's name, "
        f"or {TINY_MODEL_NAME} for the built-in model)",
    )
    p.add_argument(
        "--model",
        help="local Hugging Face model directory the replicas run: its tokenizer, chat template and "
        "context length (default: the local stack's model, else the built-in tiny model)",
    )
    p.add_argument(
        "--token-file",
        help="file with the node's shared gRPC token for the replicas (default: $KVTIER_TOKEN, else "
        "$KVTIER_TOKEN_FILE, else the run directory's token file; never sent to HTTP clients)",
    )
    p.add_argument(
        "--max-n", type=int, default=16, help="largest `n` (completions per prompt) a request may ask for"
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),  # gateway.tools.PARSERS (tests/test_tools.py checks they match)
        default="hermes",
        help="how tool calls are read from the model's output under tool_choice auto: hermes = "
        '<tool_call>{json}</tool_call> blocks, llama3_json = the output is {"name": ..., "parameters": ...}',
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        help="largest request body in bytes, answered 413 past it (default: twice the prompt limit, "
        "16 bytes per token of context, plus 64 KiB; at least 1 MiB)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument(
        "--no-uvloop",
        dest="uvloop",
        action="store_false",
        help="run on asyncio's own event loop even when uvloop is installed (it is used when it is)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (stderr)",
    )
    return p


def parse_config(argv: list[str] | None = None, prog: str = "python -m kvtier.gateway") -> GatewayConfig:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("KVTIER_API_KEY") or None
    args.nodes = _nodes(args, parser)
    if args.nodes is not None:
        args.compute = [c for node in args.nodes for c in node.compute]
    try:
        args.nodes_dns = parse_dns_flag(args.nodes_dns) if args.nodes_dns else None
    except NodeFileError as e:
        raise SystemExit(str(e)) from None
    if args.nodes_dns:  # found (and found again) by the router at run time
        args.nodes, args.compute = [], []
    del args.node, args.node_file
    if args.routing_load_weight < 0:
        raise SystemExit(f"--routing-load-weight must be >= 0, got {args.routing_load_weight}")
    if args.compute is None:  # the local stack's replicas, and its model unless --model says
        from kvtier import auth
        from kvtier.cli.stack_file import running_stack

        stack = running_stack(auth.run_dir())
        if stack is None:
            raise SystemExit(
                f"no --compute given and no local stack is serving in {auth.run_dir()} (start one with "
                "`kvtier up`, or name the replicas: --compute unix:///path/compute-0.sock ...)"
            )
        args.compute = list(stack["compute"])
        args.model = args.model or stack.get("model")
        if stack.get("nodes"):  # `kvtier up --nodes N`: route across them
            args.nodes = [Node(n["name"], n["cache"], list(n["compute"])) for n in stack["nodes"]]
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).resolve().name if args.model else TINY_MODEL_NAME
    if args.api_keys and args.api_key:
        raise SystemExit("give --api-key (one shared key) or --api-keys FILE (keys per tenant), not both")
    if args.max_n < 1:
        raise SystemExit(f"--max-n must be >= 1, got {args.max_n}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise SystemExit(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    return GatewayConfig(**vars(args))


def _nodes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Node] | None:
    """The nodes --node / --node-file / --nodes-dns name (one of them), or None."""
    given = [
        flag
        for flag, value in (
            ("--node", args.node),
            ("--node-file", args.node_file),
            ("--nodes-dns", args.nodes_dns),
        )
        if value
    ]
    if not given:
        return None
    if len(given) > 1 or args.compute:
        raise SystemExit(
            f"give one of --compute, --node, --node-file, --nodes-dns (got {', '.join(given)}{' and --compute' if args.compute else ''})"
        )
    try:
        if args.node:
            return [parse_node_flag(spec, k) for k, spec in enumerate(args.node)]
        if args.node_file:
            return load_node_file(args.node_file)
        return None  # --nodes-dns: the router resolves it
    except NodeFileError as e:
        raise SystemExit(str(e)) from None
