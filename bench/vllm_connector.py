"""kvtier as vLLM's KV cache (issue 33): what the connector buys and what it costs, in one run.

Real processes: a cache service and vLLM OpenAI servers (the CPU build) on the serving
benchmark's random byte Llama (hidden 256, 4 layers, 4 heads, 2 KV heads; 4,096 positions here,
bfloat16: vLLM's CPU default). Engines A and B run ``KvtierConnector``; engine C is the same engine
without it.

- TTFT: engine B serving a prompt whose 2,000-token prefix engine A computed (loaded from kvtier)
  against B recomputing a prefix of the same length nobody computed. Target <= 0.3x.
- Throughput: a no-reuse workload (unique random prompts, every block saved to kvtier) on B against
  the same workload on C. Target >= 0.95x: the save path must not slow serving.
- Copy rates, in this process: loads (pool -> vLLM blocks) and saves (vLLM blocks -> staging ->
  pool) through the connector's own ``BlockCopier``, with vLLM's CPU block layout for bfloat16
  learned from its own KV write as the connector learns it, against a plain memory copy of the same
  blocks (index_select + index_copy_ of the same bytes): the floor.

    python bench/vllm_connector.py            # 3 TTFT rounds, 48 throughput requests
    python bench/vllm_connector.py --quick    # 1 round, 24 requests

The last line is the headline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from models import random_llama_dir

BLOCK_SIZE = 32
PREFIX_TOKENS = 2000
KV_CONFIG = json.dumps(
    {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A vLLM OpenAI server; `connector` adds KvtierConnector."""

    def __init__(
        self, name: str, model: Path, run_dir: Path, env: dict[str, str], connector: bool, gpu: bool
    ):
        self.name, self.model, self.port = name, str(model), free_port()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
            "--port", str(self.port), "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096",
            "--enforce-eager", "--distributed-executor-backend", "uni", "--dtype", "bfloat16",
        ] + (["--kv-transfer-config", KV_CONFIG] if connector else [])  # fmt: skip
        if gpu:  # three engines and the pool share one device
            command += ["--gpu-memory-utilization", "0.2"]
        self.log = run_dir / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return
            except OSError:
                time.sleep(0.5)  # polling readiness with a deadline
        raise TimeoutError(f"{self.name} not serving after {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(60)

    def ttft(self, prompt: list[int], max_tokens: int = 1) -> float:
        """Seconds to the first streamed token of a greedy completion."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as reply:
            for line in reply:
                if line.startswith(b"data: {"):
                    first = time.perf_counter() - start
                    for _ in reply:  # drain the stream
                        pass
                    return first
        raise RuntimeError("no token streamed")

    def complete(self, prompt: list[int], max_tokens: int) -> int:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.load(reply)["usage"]["completion_tokens"]


def throughput(server: Server, seed: int, count: int, concurrency: int = 8) -> float:
    """Generated tokens per second over `count` unique 512-token prompts, 32 tokens each."""
    prompts = [tokens(seed * 1000 + i, 512) for i in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(lambda p: server.complete(p, 32), prompts))
    return generated / (time.perf_counter() - start)


def wait_saved(cache_address: str, token: str, prompt: list[int]) -> None:
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(cache_address, token, timeout_s=10)
    want = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            reply = client.lookup_prefix([prompt])
            held = reply.num_cached_tokens[0] + sum(
                t[0] for t in (reply.num_host_tokens, reply.num_disk_tokens) if t
            )
            if held >= want:
                return
            time.sleep(0.05)  # the save lands after the step: polled with a deadline
    finally:
        client.close()
    raise TimeoutError(f"the prefix was not saved to kvtier within 120 s ({held} of {want} tokens)")


class _CpuLayer:
    """vLLM's CPU attention write for one layer, as its backend calls it (the connector's probe target)."""

    def __init__(self, dtype, head_dim: int):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.isa = _get_attn_isa(dtype, BLOCK_SIZE, head_dim)
        self.impl = self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = kv_cache.shape
        view = kv_cache.view(blocks, heads, block_size * 2, -1)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, self.isa)


def copy_rates(
    num_layers: int, heads: int, head_dim: int, device: str, blocks: int = 256, repeats: int = 5
) -> dict[str, float]:
    """GB/s of the connector's loads and saves against a plain copy of the same blocks (bfloat16).
    On CPU with vLLM's CPU layout for bfloat16, learned from its write op; on a GPU (device to
    device) with a layout as kvtier's (the connector learns the real one inside the engine)."""
    import torch

    from kvtier.pool import private_pool
    from kvtier.vllm.block_layout import BlockCopier, probe_layout

    dtype = torch.bfloat16
    shape = (4 * blocks, heads, BLOCK_SIZE, 2 * head_dim)
    caches = [torch.randn(shape, device=device).to(dtype) for _ in range(num_layers)]
    if device == "cpu":
        layer = _CpuLayer(dtype, head_dim)
        gathers = [probe_layout(layer, cache, BLOCK_SIZE, heads, head_dim) for cache in caches]
    else:
        gathers = [torch.arange(2 * BLOCK_SIZE * heads * head_dim, device=device)] * num_layers
    copier = BlockCopier(caches, gathers, (2, BLOCK_SIZE, heads, head_dim))
    pool = private_pool([4 * blocks, num_layers, 2, BLOCK_SIZE, heads, head_dim], "bfloat16", device).tensor
    vllm_ids = torch.randperm(4 * blocks, device=device)[:blocks]
    pool_ids = torch.randperm(4 * blocks, device=device)[:blocks]
    flat_src = torch.randn(4 * blocks, copier.block_bytes // 2, device=device).to(dtype)
    flat_dst = torch.empty_like(flat_src)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return blocks * copier.block_bytes / min(times) / 1e9

    return {
        "layout": "permuted" if any(g is not None for g in copier.gathers) else "as kvtier's",
        "load_gbs": best(lambda: copier.write_blocks(vllm_ids, pool.index_select(0, pool_ids))),
        "save_gbs": best(lambda: pool.index_copy_(0, pool_ids, copier.read_blocks(vllm_ids))),
        "memcpy_gbs": best(lambda: flat_dst.index_copy_(0, pool_ids, flat_src.index_select(0, vllm_ids))),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one TTFT round, 24 throughput requests")
    args = ap.parse_args()
    rounds, requests = (1, 24) if args.quick else (3, 48)
    import torch

    from kvtier.cli.stack import LocalStack

    gpu = torch.cuda.is_available()
    rates = copy_rates(num_layers=4, heads=2, head_dim=64, device="cuda" if gpu else "cpu")
    print(f"copies (bfloat16 on {'cuda' if gpu else 'cpu'}, vLLM's layout {rates['layout']}): load {rates['load_gbs']:.2f} GB/s, "
          f"save {rates['save_gbs']:.2f} GB/s, plain copy {rates['memcpy_gbs']:.2f} GB/s", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        run_dir = Path(tmp)
        os.chmod(run_dir, 0o700)
        model = random_llama_dir(
            run_dir / "model", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=4096
        )
        token = "bench-token-0123456789"
        env = {**os.environ, "KVTIER_RUN_DIR": str(run_dir), "KVTIER_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        cache_args = ["--model", str(model), "--block-size", str(BLOCK_SIZE), "--kv-cache-dtype", "bfloat16",
                      "--num-blocks", "4096", "--compute-replicas", "0"]  # fmt: skip
        stack = LocalStack(run_dir, cache_args=cache_args, num_replicas=0, env=env)
        stack.start_cache()
        servers = [Server(n, model, run_dir, env, connector=n != "C", gpu=gpu) for n in ("A", "B", "C")]
        try:
            for server in servers:
                server.wait()
            a, b, c = servers
            for server in servers:  # first requests pay one-time setup (oneDNN primitives): not measured
                server.ttft(tokens(5, PREFIX_TOKENS + 32))
                throughput(server, 3, 8)
            loaded, recomputed = [], []
            for rnd in range(rounds):
                prefix = tokens(10 + rnd, PREFIX_TOKENS)
                a.ttft(prefix + tokens(20 + rnd, 32))
                wait_saved(stack.cache_address, token, prefix)
                loaded.append(b.ttft(prefix + tokens(30 + rnd, 32)))
                recomputed.append(b.ttft(tokens(40 + rnd, PREFIX_TOKENS) + tokens(50 + rnd, 32)))
                print(f"round {rnd}: TTFT loaded {loaded[-1] * 1e3:.0f} ms, recomputed {recomputed[-1] * 1e3:.0f} ms",
                      flush=True)  # fmt: skip
            ttft_ratio = statistics.median(loaded) / statistics.median(recomputed)
            # Alternating halves, so other load on the machine falls on both alike.
            half = requests // 2
            with_runs, without_runs = [], []
            for rnd in range(2):
                with_runs.append(throughput(b, 10 + rnd, half))
                without_runs.append(throughput(c, 20 + rnd, half))
            with_connector, without = statistics.mean(with_runs), statistics.mean(without_runs)
            print(f"throughput, no reuse: with the connector {with_connector:.1f} tok/s, without {without:.1f} tok/s",
                  flush=True)  # fmt: skip
        finally:
            for server in servers:
                server.stop()
            stack.down()
    print(
        f"vLLM + kvtier: TTFT with A's 2,000-token prefix loaded {ttft_ratio:.2f}x recompute (<= 0.3); "
        f"no-reuse throughput with/without the connector {with_connector / without:.3f} (>= 0.95); "
        f"loads {rates['load_gbs']:.2f} GB/s, saves {rates['save_gbs']:.2f} GB/s vs a plain copy "
        f"{rates['memcpy_gbs']:.2f} GB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
