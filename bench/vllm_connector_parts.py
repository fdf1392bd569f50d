"""bench/vllm_connector.py's parts: a vLLM OpenAI server as the benchmark drives it, its workloads,
and the connector's copy rates measured in this process."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK_SIZE = 32


NULL_CONNECTOR = '''"""A KV connector that does nothing: what vLLM's connector hooks cost by themselves."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NullConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
'''


def kv_config(role: str) -> str:
    """vLLM's --kv-transfer-config for KvtierConnector in ``role`` (kv_both, kv_producer: saves
    only, kv_consumer: loads only; "kv_both/index": kv_both with ``block_index`` on), or
    "null": NULL_CONNECTOR (its module on the engine's path)."""
    role, _, variant = role.partition("/")
    connector, module = (
        ("NullConnector", "null_connector")
        if role == "null"
        else ("KvtierConnector", "kvtier.vllm.connector")
    )
    return json.dumps(
        {
            "kv_connector": connector,
            "kv_connector_module_path": module,
            "kv_role": "kv_both" if role == "null" else role,
            "kv_load_failure_policy": "recompute",
            **({"kv_connector_extra_config": {"block_index": True}} if variant == "index" else {}),
        }
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A vLLM OpenAI server; `role` adds KvtierConnector in that kv_role (the only difference
    between engines; None: without it)."""

    def __init__(
        self, name: str, model: Path, run_dir: Path, env: dict[str, str], role: str | None, gpu: bool
    ):
        self.name, self.model, self.port = name, str(model), free_port()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
            "--port", str(self.port), "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096",
            "--enforce-eager", "--distributed-executor-backend", "uni", "--dtype", "float32",
        ] + (["--kv-transfer-config", kv_config(role)] if role else [])  # fmt: skip
        if gpu:  # three engines and the pool share one device
            command += ["--gpu-memory-utilization", "0.2"]
        self.log = run_dir / f"{name}.log"
        if role == "null":  # a bench-only module, on this engine's path only
            (run_dir / "null").mkdir(exist_ok=True)
            (run_dir / "null" / "null_connector.py").write_text(NULL_CONNECTOR)
            env = {**env, "PYTHONPATH": str(run_dir / "null")}
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

    def _request(self, prompt: list[int], max_tokens: int, stream: bool) -> urllib.request.Request:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}  # fmt: skip
        return urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip

    def ttft(self, prompt: list[int], max_tokens: int = 1) -> float:
        """Seconds to the first streamed token of a greedy completion."""
        start = time.perf_counter()
        with urllib.request.urlopen(self._request(prompt, max_tokens, stream=True), timeout=600) as reply:
            for line in reply:
                if line.startswith(b"data: {"):
                    first = time.perf_counter() - start
                    for _ in reply:  # drain the stream
                        pass
                    return first
        raise RuntimeError("no token streamed")

    def complete(self, prompt: list[int], max_tokens: int) -> int:
        with urllib.request.urlopen(self._request(prompt, max_tokens, stream=False), timeout=600) as reply:
            return json.load(reply)["usage"]["completion_tokens"]


def throughput(server: Server, seed: int, count: int, concurrency: int = 8) -> float:
    """Generated tokens per second over `count` unique 512-token prompts, 32 tokens each."""
    prompts = [tokens(seed * 1000 + i, 512) for i in range(count)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(lambda p: server.complete(p, 32), prompts))
    return generated / (time.perf_counter() - start)


def thread_cpu(root_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of every thread of ``root_pids`` and their descendants, by
    "process/thread": the process's name, then "main" (the thread whose id is the process's),
    the thread's own OS name (the connector's: kvtier-alloc, kvtier-free, kvtier-prefix, kvtier-lookup; gRPC's
    and OpenMP's name theirs), or "python threads" (unnamed: the process's name)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, cpu = list(root_pids), {}
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            comm, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
            thread = "main" if task.name == str(pid) else "python threads" if comm == process else comm
            key = f"{process}/{thread}"
            cpu[key] = cpu.get(key, 0.0) + (int(rest[11]) + int(rest[12])) / tick
    return cpu


def wait_saved(cache_address: str, token: str, prompt: list[int]) -> None:
    from kvtier.cache_client import CacheClient

    client = CacheClient.connect(cache_address, token, timeout_s=10)
    want = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            held = client.lookup_prefix([prompt])[0].total
            if held >= want:
                return
            time.sleep(0.05)  # the save lands after the step: polled with a deadline
    finally:
        client.close()
    raise TimeoutError(f"the prefix was not saved to kvtier within 120 s ({held} of {want} tokens)")


def copy_rates(
    num_layers: int,
    heads: int,
    head_dim: int,
    device: str,
    blocks: int,
    repeats: int = 7,
    pool_blocks: int = 0,
) -> dict[str, float]:
    """GB/s of the connector's loads and saves of `blocks` blocks (float32) against a plain copy of
    the same bytes, and the load's ms. On CPU with vLLM's CPU layout, learned from its write op; on
    a GPU (device to device) with its FlashAttention layout (``FlashWrite``: vLLM's CUDA build is
    not installed there). The ids are consecutive on both sides, as a fresh request's blocks mostly are.
    These copies repeat on the same blocks (in the CPU's caches after the first); on CPU with
    ``pool_blocks``, ``cold_save_rates`` too."""
    import torch

    from kvtier.pool import private_pool
    from kvtier.vllm.backend_writes import CpuWrite, FlashWrite
    from kvtier.vllm.block_layout import BlockCopier, probe_layout

    dtype, total = torch.float32, 4 * blocks
    shape = (total, heads, BLOCK_SIZE, 2 * head_dim)
    # As vLLM 0.32 allocates them (allocate_kv_cache): every layer a view of one buffer.
    caches = list(torch.randn((num_layers, *shape), device=device, dtype=dtype).unbind(0))
    layer = CpuWrite(dtype, BLOCK_SIZE, head_dim) if device == "cpu" else FlashWrite(head_dim)
    gathers = [probe_layout(layer, cache, BLOCK_SIZE, heads, head_dim) for cache in caches]
    copier = BlockCopier(caches, gathers, (2, BLOCK_SIZE, heads, head_dim))
    pool = private_pool([total, num_layers, 2, BLOCK_SIZE, heads, head_dim], "float32", device).tensor
    vllm_ids = list(range(blocks, 2 * blocks))
    pool_ids = list(range(blocks))
    flat_src = torch.randn(total, copier.block_bytes // 4, device=device, dtype=dtype)
    flat_dst = torch.empty_like(flat_src)
    v_t, p_t = torch.tensor(vllm_ids, device=device), torch.tensor(pool_ids, device=device)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    load_s = timed(lambda: copier.load(pool, pool_ids, vllm_ids))
    save_s = timed(lambda: copier.save(pool, pool_ids, vllm_ids))
    rows = flat_src.index_select(0, v_t)  # gathered beforehand: the floor is one pass over the bytes
    memcpy_s = timed(lambda: flat_dst.index_copy_(0, p_t, rows))
    size = blocks * copier.block_bytes
    cold = cold_save_rates(copier, vllm_ids, pool_blocks, repeats) if device == "cpu" and pool_blocks else {}
    return {
        **cold,
        "layout": "permuted" if any(g is not None for g in copier.gathers) else "as kvtier's",
        "load_gbs": size / load_s / 1e9,
        "load_ms": load_s * 1e3,
        "save_gbs": size / save_s / 1e9,
        "save_ms": save_s * 1e3,
        "memcpy_gbs": size / memcpy_s / 1e9,
    }


def cold_save_rates(copier, vllm_ids: list[int], pool_blocks: int, repeats: int) -> dict[str, float]:
    """Saves as an engine makes them: into a shared-memory pool of ``pool_blocks`` blocks (its pages
    mapped up front, as the worker maps the cache's pool), each repeat into blocks no copy has
    touched (not in the CPU's caches), against a plain copy of the same bytes into other untouched
    blocks of the same pool (``index_copy_``: one pass): GB/s of each; none for a pool too small
    for one repeat."""
    import torch

    from kvtier.pool import create_pool, default_backend
    from kvtier.vllm.worker import map_pages

    blocks, shape = len(vllm_ids), copier.block_shape
    layers = copier.num_layers
    pool = create_pool(default_backend(), [pool_blocks, layers, *shape], "float32")
    try:
        map_pages(pool.tensor)
        flat = pool.tensor.view(pool_blocks, -1)
        src = torch.randn(blocks, copier.block_bytes // 4)  # the same bytes a block, in this process's memory
        saves, plain, start = [], [], 0
        for _ in range(repeats):
            if start + 2 * blocks > pool_blocks:
                break
            ids = list(range(start, start + blocks))
            begin = time.perf_counter()
            copier.save(pool.tensor, ids, vllm_ids)
            saves.append(time.perf_counter() - begin)
            dst = torch.arange(start + blocks, start + 2 * blocks)
            begin = time.perf_counter()
            flat.index_copy_(0, dst, src)
            plain.append(time.perf_counter() - begin)
            start += 2 * blocks
    finally:
        pool.close()  # and unlinked: this process made it
    if not saves:
        return {}
    size = blocks * copier.block_bytes
    return {"cold_save_gbs": size / min(saves) / 1e9, "cold_memcpy_gbs": size / min(plain) / 1e9}
