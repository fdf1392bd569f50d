"""The gateway's configuration: flags and environment, one dataclass."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path

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

    def describe(self) -> str:
        """One line for the log; the API key is never printed."""
        fields = asdict(self) | {"api_key": "set" if self.api_key else "none"}
        return " ".join(f"{k}={v}" for k, v in fields.items())


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds `(default: X)` only where the help does not say the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser(prog: str = "python -m gateway") -> argparse.ArgumentParser:
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


def parse_config(argv: list[str] | None = None, prog: str = "python -m gateway") -> GatewayConfig:
    args = build_parser(prog).parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("KVTIER_API_KEY") or None
    if args.compute is None:  # the local stack's replicas, and its model unless --model says
        from kvtier import auth
        from kvtier.stack import running_stack

        stack = running_stack(auth.run_dir())
        if stack is None:
            raise SystemExit(
                f"no --compute given and no local stack is serving in {auth.run_dir()} (start one with "
                "`kvtier up`, or name the replicas: --compute unix:///path/compute-0.sock ...)"
            )
        args.compute = list(stack["compute"])
        args.model = args.model or stack.get("model")
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).resolve().name if args.model else TINY_MODEL_NAME
    if args.api_keys and args.api_key:
        raise SystemExit("give --api-key (one shared key) or --api-keys FILE (keys per tenant), not both")
    if args.max_n < 1:
        raise SystemExit(f"--max-n must be >= 1, got {args.max_n}")
    return GatewayConfig(**vars(args))
