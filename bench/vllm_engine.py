"""vLLM's CPU engine as a baseline system: offline `LLM.generate` in a child process, or vLLM's
OpenAI HTTP server, both on a model directory the benchmark wrote.

vLLM runs in processes of its own (the child here starts its EngineCore and worker), so its
threads, allocator preload and memory never mix with kvtier's, and both can stay up for an ABBA
run. Its best configuration on a CPU box, per its CPU docs and as measured in issue 35: one
engine using every core (OMP_NUM_THREADS), tcmalloc and Intel OpenMP preloaded, prefix caching
on, block size 32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from kvtier.cpu_plan import allocator_libs, preload_env


def vllm_env(threads: int, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment vLLM's CPU engine runs best in here: `threads` OpenMP threads, tcmalloc and
    Intel OpenMP preloaded where present, a small KV cache."""
    env = preload_env(dict(os.environ), allocator_libs(iomp=True))
    env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _serve(fd: int, model_dir: str, max_model_len: int) -> None:
    """The child: one `LLM`, answering (prompts, max_tokens, salt) with (token ids, seconds)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    conn = Connection(fd)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=32,
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        seed=0,
    )
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, max_tokens, salt = job
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        conn.send(([list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0))


class OfflineVllm:
    """vLLM's offline engine in a child process (`python bench/vllm_engine.py`, with `vllm_env`'s
    environment), driven over a socket pair."""

    name = "vllm"

    def __init__(self, model_dir: Path, threads: int, max_model_len: int = 2048):
        self.model_dir, self.threads, self.max_model_len = model_dir, threads, max_model_len
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def start(self, timeout_s: float = 900.0) -> None:
        self.conn, child = Pipe()
        args = [sys.executable, __file__, str(child.fileno()), str(self.model_dir), str(self.max_model_len)]
        self.proc = subprocess.Popen(args, env=vllm_env(self.threads), pass_fds=[child.fileno()])
        child.close()
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(
                    f"vLLM's engine did not start (exit code {self.proc.wait()}): its log is above"
                )
        if self.conn.recv() != "ready":
            raise RuntimeError("vLLM's engine did not start")

    def generate(self, prompts: list[list[int]], max_tokens: int, salt: str) -> tuple[list[list[int]], float]:
        """Greedy completions of `prompts` (EOS ignored) and the seconds `generate` took."""
        self.conn.send((prompts, max_tokens, salt))
        return self.conn.recv()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.conn.send(None)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class VllmHttpServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free port, the same model and settings."""

    name = "vllm-http"

    def __init__(self, model_dir: Path, threads: int, port: int, log_path: Path, max_model_len: int = 2048):
        self.model_dir, self.threads, self.port, self.log_path = model_dir, threads, port, log_path
        self.max_model_len = max_model_len
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> None:
        import urllib.request

        cmd = [
            sys.executable,
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)),
            *("--dtype", "float32", "--block-size", "32", "--enable-prefix-caching"),
            *("--max-model-len", str(self.max_model_len), "--port", str(self.port), "--host", "127.0.0.1"),
            *("--seed", "0"),
        ]
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=vllm_env(self.threads), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"vLLM's server not up after {timeout_s:.0f}s: {self.log_path}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
