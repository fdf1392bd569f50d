"""`kvtier`: run the cache service, compute replicas or the whole local stack, and talk to it.

    kvtier up --replicas 2            # cache service + 2 compute replicas + the HTTP gateway, until Ctrl-C
    kvtier up --nodes 2 --replicas 2  # two nodes (a cache service and pool each), the gateway routing across them
    kvtier serve --port 8000          # the OpenAI-compatible gateway alone, in front of a running stack
    kvtier demo                       # a workload with shared system prompts against the stack
    kvtier generate "Once upon a time" --max-tokens 32
    kvtier stats                      # the cache services' block usage and hit rate (each node, totals)
    kvtier down                       # stop the stack `kvtier up` runs, from another shell
    kvtier cache --help / kvtier compute --help

The services run as their own processes (`python -m kvtier.cachesvc`, `python -m kvtier.computesvc`,
`python -m kvtier.gateway`); this module starts them and never imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvtier import __version__, auth
from kvtier.cli.stats import cmd_stats
from kvtier.cpu_plan import plan_for_flags

PASSTHROUGH = {"cache": "kvtier.cachesvc", "compute": "kvtier.computesvc", "serve": "kvtier.gateway"}


def _passthrough(command: str, argv: list[str]) -> int:
    """Become `python -m MODULE argv` with its usage and errors naming `kvtier COMMAND`, the
    command the user typed (the module is imported by the new process, never here)."""
    run = f"import sys; from {PASSTHROUGH[command]}.__main__ import main; sys.exit(main(sys.argv[1:], {f'kvtier {command}'!r}))"
    os.execv(sys.executable, [sys.executable, "-c", run, *argv])
    return 0  # pragma: no cover


def _checked_api_keys(path: str) -> str:
    """The api-keys file as an absolute path, after checking it loads (its error at once, here)."""
    from kvtier.api_keys import ApiKeys, ApiKeysError

    try:
        ApiKeys.load(path)
    except ApiKeysError as e:
        raise SystemExit(str(e)) from None
    return str(Path(path).resolve())


def _service_args(args) -> tuple[list[str], list[str], list[str]]:
    """The flags `kvtier up` gives the cache service, each compute replica and the gateway. The
    cache service learns how many replicas share its device (--compute-replicas: on cuda its
    pool leaves room for their weights and activations)."""
    cache_args = ["--num-blocks", str(args.num_blocks), "--swap-space", str(args.swap_space)]
    if args.host_cache_gib != "auto":  # auto is the service's own default: its log says what it chose
        cache_args += ["--host-cache-gib", args.host_cache_gib]
    cache_args += ["--compute-replicas", str(args.replicas), "--block-size", str(args.block_size)]
    compute_args = ["--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads)]
    compute_args += getattr(args, "compute_flag", None) or []
    # Every process serves Prometheus metrics on a free port; the stack file records the URLs.
    cache_args += ["--metrics-port", "0"]
    compute_args += ["--metrics-port", "0"]
    if args.model:
        cache_args += ["--model", args.model]
        compute_args += ["--model", args.model]
    gateway_args = ["--model", args.model] if args.model else []
    if routing := getattr(args, "routing", None):
        gateway_args += ["--routing", routing, "--routing-load-weight", str(args.routing_load_weight)]
    if keys := getattr(args, "api_keys", None):
        keys = _checked_api_keys(keys)
        cache_args += ["--tenant-quotas", keys]
        compute_args += ["--api-keys", keys]
        gateway_args += ["--api-keys", keys]
    return cache_args, compute_args, gateway_args


def _stack(args) -> tuple[object, dict]:
    """A running stack in the run dir, or a new one (returned so the caller stops it)."""
    from kvtier.cli.stack import LocalStack, MultiNodeStack
    from kvtier.cli.stack_file import recorded_stack, running_stack

    run_dir = auth.run_dir()
    info = running_stack(run_dir)
    if info is not None and not getattr(args, "fresh", False):
        return None, info
    if getattr(args, "fresh", False):
        run_dir = Path(tempfile.mkdtemp(prefix="kvtier-"))
        os.environ["KVTIER_RUN_DIR"] = str(run_dir)  # where this process finds the new stack's token
    plan = plan_for_flags(args)  # --replicas / --threads left out: chosen for this machine
    cache_args, compute_args, gateway_args = _service_args(args)
    gateway = getattr(args, "gateway", False)
    num_nodes = getattr(args, "nodes", 1)
    common = {
        "cache_args": cache_args,
        "compute_args": compute_args,
        "num_replicas": args.replicas,
        "gateway_args": gateway_args if gateway else None,
        "gateway_port": getattr(args, "gateway_port", 0),
        "model": args.model,
    }
    shared_gib = getattr(args, "shared_tier", 0.0)
    if num_nodes > 1 or shared_gib:
        stack = MultiNodeStack(run_dir, num_nodes, shared_tier_gib=shared_gib, **common)
        what = f"{num_nodes} nodes, each a cache service (its own pool) + {args.replicas} compute replicas"
        what += f", sharing a {shared_gib:g} GiB Mooncake Store" if shared_gib else ""
    else:
        stack = LocalStack(run_dir, **common)
        what = f"cache service + {args.replicas} compute replicas"
    print(
        f"starting the local stack in {run_dir}: {what}"
        f"{' + the HTTP gateway (KV-aware routing)' if gateway and num_nodes > 1 else ' + the HTTP gateway' if gateway else ''}; compute: {plan.describe()} …",
        flush=True,
    )
    try:
        stack.up()
    except (RuntimeError, TimeoutError) as e:  # a service exited or never got ready: its log says why
        raise SystemExit(f"could not start the local stack: {e}") from None
    info = {"cache": stack.cache_address, "compute": stack.compute_addresses}
    if num_nodes > 1:
        info["nodes"] = [(n.cache_address, n.compute_addresses) for n in stack.nodes]
    if stack.gateway is not None:
        info["gateway"] = stack.gateway.address
    info["metrics"] = recorded_stack(stack.run_dir).get("metrics", {})  # every process's URL
    return stack, info


class Terminated(SystemExit):
    """SIGTERM or SIGHUP reached a command that started a stack: stop it on the way out."""


def _stop_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into an exception, so the `finally` that stops the stack runs (a
    signal's default action would end this process and orphan the services it started)."""

    def terminate(_signum, _frame):
        raise Terminated(0)  # a requested stop, like Ctrl-C: not a failure

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, terminate)
    # NOTE: a process started in the background of a non-interactive shell inherits SIGINT as
    # ignored, and Python then never raises KeyboardInterrupt: Ctrl-C (or `kill -INT`) must stop
    # the stack however this process was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_up(args) -> int:
    from kvtier.cli.supervisor import GiveUp, Supervisor

    if args.nodes < 1:
        raise SystemExit(f"--nodes must be >= 1, got {args.nodes}")
    _stop_on_signals()
    stack = None
    # NOTE: everything after the stack exists runs inside this try, so a signal that arrives at
    # any point (even right after the line that says the stack serves) still stops every process.
    try:
        stack, info = _stack(args)
        if stack is None:
            print(f"a stack is already serving in {auth.run_dir()}: {info}")
            return 0
        if "nodes" in info:
            for i, node in enumerate(info["nodes"]):
                cache, compute = (node["cache"], node["compute"]) if isinstance(node, dict) else node
                print(f"node {i}: cache service {cache}")
                for address in compute:
                    print(f"node {i}: compute replica {address}")
        else:
            print(f"cache service:    {info['cache']}")
            for address in info["compute"]:
                print(f"compute replica:  {address}")
        if "gateway" in info:
            print(f"OpenAI API:       {info['gateway']}/v1  (gateway; GET {info['gateway']}/health)")
        for name, url in info.get("metrics", {}).items():
            print(f"metrics:          {url}  ({name})")
        print(
            f'logs in {stack.run_dir}; try `kvtier generate "hello"` or `kvtier demo` in another shell. '
            "Ctrl-C or `kvtier down` stops.",
            flush=True,
        )
        supervisor = Supervisor(stack)
        while True:  # until Ctrl-C, SIGTERM or a service that keeps failing
            for line in supervisor.step():
                print(line, file=sys.stderr, flush=True)
            time.sleep(0.2)
    except GiveUp as e:
        print(f"{e}\nstopping the stack", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if stack is not None:
            stack.down()


def cmd_down(args) -> int:
    """Stop the stack `kvtier up` runs in the run directory, from any shell."""
    from kvtier.cli.stack_file import stop_stack

    run_dir = auth.run_dir()
    stopped = stop_stack(run_dir, timeout_s=args.timeout)
    if not stopped:
        print(f"no stack runs in {run_dir} (no {run_dir}/stack.json, or its processes are gone)")
        return 0
    print(f"stopped {', '.join(stopped)} in {run_dir}")
    return 0


async def _generate(info: dict, args) -> int:
    from kvtier import telemetry
    from kvtier.compute_client import ComputeClient

    client = ComputeClient(info["compute"])
    request = client.request(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        cache_salt=args.cache_salt,
    )
    # The root of the request's trace when tracing is configured (a no-op span when it is not).
    with telemetry.tracer("kvtier.cli").start_as_current_span("kvtier.generate") as span:
        span.set_attribute("kvtier.max_tokens", args.max_tokens)
        try:
            async for reply in client.stream(request):
                print(reply.text, end="", flush=True)
                if reply.finish_reason:
                    u = reply.usage
                    span.set_attribute("kvtier.finish_reason", reply.finish_reason)
                    span.set_attribute("kvtier.completion_tokens", u.completion_tokens)
                    print(
                        f"\n[{reply.finish_reason}: {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} cached), "
                        f"{u.completion_tokens} completion tokens]",
                        file=sys.stderr,
                    )
        finally:
            await client.close()
    return 0


def cmd_generate(args) -> int:
    from kvtier import telemetry

    _stop_on_signals()
    # Before any channel is made; the services it may start keep their own names (kvtier.cli.stack).
    try:
        telemetry.setup_tracing("kvtier-cli")
    except ValueError as e:  # an OTLP protocol we do not speak
        raise SystemExit(f"tracing: {e}") from None
    stack = None
    try:
        stack, info = _stack(args)
        return asyncio.run(_generate(info, args))
    finally:
        telemetry.shutdown_tracing()  # the client span is exported before the stack stops
        if stack is not None:
            stack.down()


def cmd_demo(args) -> int:
    from kvtier.cli.demo import print_kv_dtypes, print_summary, run_demo

    if args.kv_dtypes:
        print_kv_dtypes(args.model, args.block_size)
        return 0
    _stop_on_signals()
    stack = None
    try:
        stack, info = _stack(args)
        summary = asyncio.run(run_demo(info, args))
    finally:
        if stack is not None:
            stack.down()
    print_summary(summary, len(info["compute"]))
    return 0 if summary["requests"] == args.requests else 1


def _gib_or_auto(value: str) -> str:
    """A --host-cache-gib value as the cache service takes it: `auto`, or GiB >= 0."""
    if value == "auto":
        return value
    try:
        gib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither `auto` nor a number of GiB") from None
    if not gib >= 0:
        raise argparse.ArgumentTypeError(f"{value} GiB: must be >= 0")
    return value


def _stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, help="compute replicas per node (default: chosen, see --threads)")
    p.add_argument("--model", help="local Hugging Face model directory (default: built-in tiny model)")
    p.add_argument(
        "--swap-space",
        type=float,
        default=0.25,
        help="GiB of host swap for preempted sequences, used only with --host-cache-gib 0 (swap takes "
        "the host cache's slots while it is on) (default: 0.25; a hand-started `kvtier cache` "
        "defaults to 4)",
    )
    p.add_argument(
        "--host-cache-gib",
        type=_gib_or_auto,
        default="auto",
        help="GiB of host memory keeping the blocks each pool evicts (a prefix-cache tier below the "
        "pool, LRU; swap shares it); auto = min(4 GiB, 10%% of the memory available), 0 = off "
        "(default: auto, as a hand-started `kvtier cache`)",
    )
    p.add_argument(
        "--num-blocks", type=int, default=2048,
        help="KV blocks in each cache service's pool (default: 2048; a hand-started `kvtier cache` sizes its pool from memory)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64), help="tokens per KV block (default: 16)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together per replica")
    p.add_argument("--threads", type=int, help="torch CPU threads per replica (default: chosen for the machine, printed at start: a replica of one "
        "thread per CPU on a 2-CPU box, else one replica on every usable CPU; tcmalloc preloaded where installed; with a GPU 2 x 1)")  # fmt: skip
    p.add_argument(
        "--compute-flag",
        action="append",
        metavar="--FLAG=VALUE",
        help="one more flag for every compute replica, as `kvtier compute --help` lists them "
        "(repeat), e.g. --compute-flag=--max-num-batched-tokens=512",
    )
    p.add_argument("--fresh", action="store_true", help="always start a new stack in a temporary directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "cache",
        help="run the cache service (python -m kvtier.cachesvc; see kvtier cache --help)",
        add_help=False,
    )
    sub.add_parser(
        "compute",
        help="run a compute replica (python -m kvtier.computesvc; see kvtier compute --help)",
        add_help=False,
    )

    sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP gateway (python -m kvtier.gateway; see kvtier serve --help)",
        add_help=False,
    )

    up = sub.add_parser(
        "up", help="start a cache service, compute replicas and the HTTP gateway locally, until Ctrl-C"
    )
    _stack_flags(up)
    up.add_argument(
        "--no-gateway",
        dest="gateway",
        action="store_false",
        help="do not start the OpenAI-compatible gateway",
    )
    up.add_argument(
        "--gateway-port",
        type=int,
        default=8000,
        help="the gateway's HTTP port on 127.0.0.1 (0 = any free port)",
    )
    up.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes to start, each a cache service with its own pool (standing for one GPU) and "
        "--replicas replicas; with more than one, the gateway routes across them (KV-aware)",
    )
    up.add_argument(
        "--shared-tier", nargs="?", type=float, const=1.0, default=0.0, metavar="GIB",
        help="start Mooncake Store (mooncake_master + a store server of GIB GiB, 1 if not given; kvtier[mooncake]) "
        "beside the nodes, every node's cache service using it as its shared tier",
    )  # fmt: skip
    up.add_argument(
        "--routing",
        choices=("kv-aware", "round-robin", "random"),
        default="kv-aware",
        help="with --nodes > 1: how the gateway picks a request's node (`kvtier serve --help`)",
    )
    up.add_argument(
        "--routing-load-weight",
        type=float,
        default=1.0,
        help="kv-aware: weight of the work queued on a node against the prefill its cached prefix saves",
    )
    up.add_argument(
        "--api-keys",
        metavar="FILE",
        help="client API keys per tenant (JSON; kvtier/api_keys.py): the replicas and the gateway take "
        "them instead of the node token for Generate, and the cache service reads each tenant's "
        "max_blocks quota from the same file",
    )
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the stack `kvtier up` runs in the run directory")
    down.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to stop")
    down.set_defaults(func=cmd_down)

    demo = sub.add_parser("demo", help="run a shared-system-prompt workload and print a summary")
    _stack_flags(demo)
    demo.add_argument("--requests", type=int, default=64, help="requests to send")
    demo.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    demo.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    demo.add_argument(
        "--kv-dtypes", action="store_true", help="print KV blocks per GiB for each --kv-cache-dtype and exit"
    )
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream one completion")
    _stack_flags(gen)
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="completion tokens at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--seed", type=int, help="sampling seed")
    gen.add_argument("--cache-salt", default="", help="tenant salt: isolates this request's cached blocks")
    gen.set_defaults(func=cmd_generate)

    stats = sub.add_parser(
        "stats", help="print the cache services' statistics as JSON (each node's and totals)"
    )
    stats.add_argument(
        "--cache",
        help="cache service address (default: every node of the stack `kvtier up` runs in the run "
        f"directory, with their totals; else {auth.default_cache_address()})",
    )
    stats.set_defaults(func=cmd_stats)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return _passthrough(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
