"""The gateway's cost: the same workload through the OpenAI HTTP API and through gRPC directly.

The local stack runs (cache service, compute replicas, the gateway; real processes) with a
seeded-random Llama of about 27M parameters (hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocabulary 4096, fp32) saved to a temporary directory. The workload: 8 shared
512-token system prompts, each request one of them plus its own 32-token question, 64 new
tokens (EOS ignored, greedy). All requests are sent at once and streamed, through
`POST /v1/completions` (aiohttp, Server-Sent Events, token-id prompts) and through
`ComputeClient.stream` (the baseline), in alternating rounds of the same run. Each pass has its
own cache_salt, so every pass starts from a cold prefix cache and shares it the same way.

    python bench/http_api.py            # 64 requests x 2 rounds each way
    python bench/http_api.py --quick    # 16 smaller requests, 1 round each way
    python bench/http_api.py --structured  # json_schema and plain requests in one batch vs plain alone
                                           # (bench/http_structured.py; its headline instead)

(Not `bench/http.py`: a script's own folder comes first on sys.path, so a bench/http.py would
shadow the standard library's `http` package for every benchmark here, which import it through
transformers and httpx.)

Reported per path: output tokens/s (completion tokens / pass wall time); TTFT p50 (request sent
-> first token received, client side), which a burst of 64 prefills makes seconds long and
noisy; the path's share of each TTFT (client TTFT minus the replica's own arrival -> first token,
from GenerateResponse.time_to_first_token_s, or the gateway's `x-kvtier-replica-ttft-s` header),
whose p50 difference is the gateway's TTFT overhead under that load; and a sequential probe (one
request at a time, cached prompt, 1 new token). Targets: HTTP tok/s >= 0.95x gRPC tok/s; TTFT
p50 overhead <= 5 ms. The last line is the headline.

The floor, in the same run: the same burst of requests against a trivial FastAPI endpoint on
uvicorn (httptools, uvloop, a process of its own, as the gateway runs) that reads the request's
JSON and streams `max_tokens` pre-made chunks with nothing behind it; its TTFT p50 is what HTTP
intake and streaming alone cost this machine under such a burst. Each server's CPU time per
streamed token (the gateway's, the floor's, from /proc) is reported beside it. HTTP bodies are
serialized before the clock starts, as the gRPC path builds its request before its clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TOKEN = "bench-http-token"
VOCAB = 4096  # the benchmark model's vocabulary (logits width)


@dataclass
class Workload:
    num_requests: int
    num_systems: int
    system_tokens: int
    question_tokens: int
    max_tokens: int

    def prompts(self, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        systems = [[rng.randrange(256) for _ in range(self.system_tokens)] for _ in range(self.num_systems)]
        return [
            systems[i % self.num_systems] + [rng.randrange(256) for _ in range(self.question_tokens)]
            for i in range(self.num_requests)
        ]


FULL = Workload(num_requests=64, num_systems=8, system_tokens=512, question_tokens=32, max_tokens=64)
QUICK = Workload(num_requests=16, num_systems=4, system_tokens=128, question_tokens=16, max_tokens=16)


@dataclass
class Result:
    ttft_s: float
    tokens: int
    error: str = ""
    replica_ttft_s: float = 0.0  # the replica's own arrival -> first token

    @property
    def path_s(self) -> float:
        """The path's share of the TTFT: what the client saw minus what the replica spent."""
        return self.ttft_s - self.replica_ttft_s


def make_model_dir(path: Path) -> tuple[Path, int]:
    from models import random_llama_dir

    random_llama_dir(
        path,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        max_positions=2048,
        intermediate_size=1408,
        vocab_size=VOCAB,
    )
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return path, params


async def grpc_one(client, prompt: list[int], max_tokens: int, salt: str) -> Result:
    request = client.request(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=salt
    )
    t0 = time.perf_counter()
    ttft, tokens, replica_ttft = 0.0, 0, 0.0
    try:
        async for reply in client.stream(request):
            if reply.token_ids and not tokens:
                ttft, replica_ttft = time.perf_counter() - t0, reply.time_to_first_token_s
            tokens += len(reply.token_ids)
    except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
        return Result(ttft, tokens, repr(e))
    return Result(ttft, tokens, replica_ttft_s=replica_ttft)


def completion_body(prompt: list[int], max_tokens: int, salt: str) -> dict:
    """A greedy, streamed /v1/completions body that runs to `max_tokens` and reports usage."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": salt,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


JSON_HEADERS = {"Content-Type": "application/json"}


async def http_one(http, url: str, prompt: list[int], max_tokens: int, salt: str) -> Result:
    # Serialized before the clock starts, as the gRPC path builds its request before its clock.
    body = json.dumps(completion_body(prompt, max_tokens, salt)).encode()
    t0 = time.perf_counter()
    ttft, tokens, finished = 0.0, 0, False
    try:
        async with http.post(f"{url}/v1/completions", data=body, headers=JSON_HEADERS) as reply:
            if reply.status != 200:
                return Result(0.0, 0, f"HTTP {reply.status}: {(await reply.read())[:200]!r}")
            replica_ttft = float(reply.headers["x-kvtier-replica-ttft-s"])
            async for line in reply.content:  # one line of the event stream at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if not ttft:
                    ttft = time.perf_counter() - t0  # the first event is the first token's
                # Parse only what is needed (the client's CPU is the machine's too): errors,
                # the finish, the usage chunk.
                if b'"error"' in line or b'"usage":{' in line:
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Result(ttft, tokens, chunk["error"]["message"])
                    tokens = chunk["usage"]["completion_tokens"]
                elif b'"finish_reason":null' not in line:
                    finished = True
    except Exception as e:  # noqa: BLE001
        return Result(ttft, tokens, repr(e))
    error = "" if finished else "stream ended without a finish_reason"
    return Result(ttft, tokens, error, replica_ttft)


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) a process has used so far; nan where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def run_pass(send, prompts: list[list[int]], max_tokens: int, salt: str) -> tuple[list[Result], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(send(p, max_tokens, salt) for p in prompts))
    return list(results), time.perf_counter() - t0


async def measure(
    addresses: list[str], url: str, floor_url: str, work: Workload, rounds: int, probes: int, pids: dict
) -> dict:
    """`pids`: {path: the server process answering it}, whose CPU time each pass records."""
    import aiohttp

    from kvtier.compute_client import ComputeClient

    client = ComputeClient(addresses, TOKEN)

    # aiohttp (C-accelerated HTTP parsing), as vLLM's serving benchmark uses: httpx's pure-Python
    # client costs milliseconds per request here, which a burst would charge to the gateway.
    def session():  # one per server: each keeps as many open connections as requests in flight
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=work.num_requests + 8),
            timeout=aiohttp.ClientTimeout(total=600),
        )

    http, floor = session(), session()
    prompts = work.prompts()
    paths = {
        "grpc": lambda p, m, s: grpc_one(client, p, m, s),
        "http": lambda p, m, s: http_one(http, url, p, m, s),
        "floor": lambda p, m, s: http_one(floor, floor_url, p, m, s),
    }
    out: dict = {name: {"results": [], "seconds": 0.0, "tok_per_s": [], "cpu_s": 0.0} for name in paths}
    try:
        # Warm both paths on a salt of their own: model code, and as many open connections as
        # requests in flight (a client keeps its HTTP connections; the gRPC channel is one).
        warm = [p[: work.question_tokens] for p in prompts]
        for name, send in paths.items():
            await run_pass(send, warm, 2, f"warm-{name}")
        for r in range(rounds):
            order = ["grpc", "http", "floor"] if r % 2 == 0 else ["floor", "http", "grpc"]
            for name in order:
                cpu = cpu_seconds(pids.get(name))
                results, seconds = await run_pass(paths[name], prompts, work.max_tokens, f"{name}-round-{r}")
                out[name]["cpu_s"] += cpu_seconds(pids.get(name)) - cpu
                out[name]["results"] += results
                out[name]["seconds"] += seconds
                tokens = sum(x.tokens for x in results)
                out[name]["tok_per_s"].append(tokens / seconds)
                print(
                    f"  round {r} {name:>4}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s",
                    flush=True,
                )
        # Sequential probe: a cached prompt, one token, one request at a time: the path's own latency.
        probe = prompts[0]
        probed = {name: paths[name] for name in ("grpc", "http")}
        for send in probed.values():
            await send(probe, 1, "probe")  # cache the prompt for this path's salt
        out["probe"] = {name: [] for name in probed}
        for _ in range(probes):
            for name, send in probed.items():
                out["probe"][name].append(await send(probe, 1, "probe"))
    finally:
        await http.close()
        await floor.close()
        await client.close()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 smaller requests, one round each way")
    ap.add_argument("--rounds", type=int, help="passes each way (alternating order); default 2, quick 1")
    ap.add_argument("--replicas", type=int, default=1, help="compute replicas")
    ap.add_argument(
        "--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads per replica"
    )
    ap.add_argument("--probes", type=int, default=20, help="sequential probe requests each way")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--structured", action="store_true", help="the structured-output run (bench/http_structured.py)"
    )
    return ap


def local_stack(run_dir: Path, model: Path, args: argparse.Namespace):
    """The stack under test (not started): cache service, args.replicas replicas, the gateway."""
    from kvtier.cli.stack import LocalStack

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(KVTIER_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    return LocalStack(
        run_dir,
        # A long lease and short prefill chunks: on a busy 2-core machine one 2048-token prefill
        # step of this model can outlast the default lease, and the replica then re-attaches.
        [
            *("--model", str(model), "--num-blocks", "4096", "--swap-space", "0"),
            *("--lease-ttl", "60", "--log-level", "WARNING"),
        ],
        [
            *("--model", str(model), "--threads", str(args.threads)),
            *("--max-num-batched-tokens", "512", "--log-level", "WARNING"),
        ],
        num_replicas=args.replicas,
        env=env,
        gateway_args=["--model", str(model), "--log-level", "WARNING"],
        gateway_port=0,
    )


def main() -> int:
    args = build_parser().parse_args()
    work = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 2)
    probes = 5 if args.quick and args.probes == 20 else args.probes
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-http-"))
    model, params = make_model_dir(tmp / "model")
    stack = local_stack(tmp / "run", model, args)
    print(
        f"model: random Llama, {params / 1e6:.1f}M params (hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 4096, "
        f"fp32); {args.replicas} replica(s) x {args.threads} threads; workload: {work.num_requests} requests = "
        f"{work.num_systems} shared {work.system_tokens}-token system prompts + {work.question_tokens}-token "
        f"questions, {work.max_tokens} new tokens each, all at once, streamed; {rounds} round(s) each way",
        flush=True,
    )
    if args.structured:
        import http_structured

        return http_structured.run(stack, work.prompts(), work.max_tokens, rounds, args.json, VOCAB)
    from http_floor import FloorServer
    from http_report import compare, print_headline, print_table, summarize

    with stack, FloorServer(work.max_tokens) as floor:
        pids = {"http": stack.gateway.proc.pid, "floor": floor.proc.pid}
        raw = asyncio.run(
            measure(stack.compute_addresses, stack.gateway.address, floor.url, work, rounds, probes, pids)
        )
    s = summarize(raw)
    print_table(s)
    s = compare(s, params)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2))
    return 0 if print_headline(s) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
