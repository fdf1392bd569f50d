"""The whole kvtier stack on one GPU, against Hugging Face on the same GPU, in one run.

Steps (each timed, its status in the report; a failed step does not stop the others):
  model          a seeded random Llama of about 1B parameters (TinyLlama's shape: hidden 2048,
                 22 layers, 32 heads, 4 KV heads, vocab 32000) built in code on the GPU, saved in
                 bfloat16 as a Hugging Face directory with the byte tokenizer; nothing downloaded
  stack          a cache service with the cuda backend (--memory-fraction of the device's total,
                 --compute-replicas 2: its logged memory plan is kept) and two compute replicas
                 loading that directory (each checks free device memory before its weights)
  parity-bf16    greedy completions through the stack (gRPC, Triton kernels, paged pool) against
                 `model.generate` (sdpa) on the same GPU in bfloat16: exact matches and the length
                 of the agreeing prefix (bfloat16 ties can break differently; reported, not asserted)
  serve          serving throughput of the same workload (R concurrent requests, P-token prompts,
                 T greedy tokens each, EOS ignored): kvtier's two replicas vs `model.generate` in
                 static batches and transformers' continuous batching (`generate_batch`), all in
                 bfloat16 on this GPU
  parity-fp32    the model runner's Triton path in float32 (in process, same kernels and pool
                 layout the replicas use) against `model.generate` in float32: must match exactly

Writes gpu_stack.json and the stack's logs (cache.log has the memory plan) to --out; prints one
`headline:` line per figure, the last one the summary. Needs a CUDA device (exits 2 otherwise);
`--help` answers without importing torch.

    python bench/gpu_stack.py --out /tmp/gpu-stack
    python bench/gpu_stack.py --out /tmp/s --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from gpu_stack_hf import (  # noqa: E402
    empty_cache,
    hf_greedy,
    hf_model,
    hf_serve_continuous,
    hf_serve_static,
    runner_greedy_fp32,
)

TOKEN = "gpu-stack-token"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_stack")
    shape = ap.add_argument_group("the random Llama (default: about 1.1B parameters)")
    shape.add_argument("--hidden", type=int, default=2048)
    shape.add_argument("--intermediate", type=int, default=5632)
    shape.add_argument("--layers", type=int, default=22)
    shape.add_argument("--heads", type=int, default=32)
    shape.add_argument("--kv-heads", type=int, default=4)
    shape.add_argument("--vocab", type=int, default=32000)
    shape.add_argument("--max-positions", type=int, default=2048)
    shape.add_argument("--seed", type=int, default=0)
    stack = ap.add_argument_group("the stack")
    stack.add_argument("--memory-fraction", type=float, default=0.5, help="cache service --memory-fraction")
    stack.add_argument("--replicas", type=int, default=2)
    stack.add_argument("--max-num-seqs", type=int, default=64, help="compute replicas' --max-num-seqs")
    work = ap.add_argument_group("workloads")
    work.add_argument("--parity-prompts", type=int, default=8)
    work.add_argument("--parity-tokens", type=int, default=32)
    work.add_argument("--requests", type=int, default=64, help="serving: concurrent requests")
    work.add_argument("--prompt-tokens", type=int, default=256, help="serving: prompt length")
    work.add_argument("--max-tokens", type=int, default=128, help="serving: output tokens per request")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=280.0,
        help="seconds for the whole run: a step that would start later is skipped (reported), so the "
        "report is written and the stack stopped before an outer timeout",
    )
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a wiring check only (cpu-shm pool, float32 everywhere; use a small --layers/--hidden)",
    )
    ap.add_argument(
        "--steps",
        nargs="+",
        default=["parity-bf16", "serve", "parity-fp32"],
        choices=["parity-bf16", "serve", "parity-fp32"],
        help="which steps after the model and the stack",
    )
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- the model


def llama_config(a: argparse.Namespace):
    from transformers import LlamaConfig

    from kvtier.model_spec import TINY_LLAMA_CONFIG

    return LlamaConfig(
        **{
            **TINY_LLAMA_CONFIG,
            "hidden_size": a.hidden,
            "intermediate_size": a.intermediate,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads,
            "vocab_size": a.vocab,
            "max_position_embeddings": a.max_positions,
        }
    )


def build_model_dir(a: argparse.Namespace, path: Path) -> dict:
    """Seeded random weights drawn on the GPU (the tiny model's scheme: unit embeddings, norms near
    1, std 1/sqrt(fan_in) elsewhere, so greedy decoding has clear winners), saved in bfloat16."""
    import torch
    from transformers import LlamaForCausalLM

    from kvtier.tokenizer import build_byte_tokenizer

    config = llama_config(a)
    with torch.device(a.device):
        model = LlamaForCausalLM(config)
    generator = torch.Generator(device=a.device).manual_seed(a.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator, device=a.device)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * values
            elif not name.endswith("embed_tokens.weight"):
                values /= param.shape[-1] ** 0.5
            param.copy_(values)
    params = sum(p.numel() for p in model.parameters())
    model = model.to(torch.bfloat16 if a.device == "cuda" else torch.float32)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.eos_token_id
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    del model
    empty_cache()
    return {"params": params, "path": str(path)}


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    prefixes = []
    for g, w in zip(got, want, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), min(len(g), len(w)))
        prefixes.append(n)
    exact = sum(g == w for g, w in zip(got, want, strict=True))
    return {
        "exact": exact,
        "prompts": len(want),
        "agreeing_prefix_tokens": prefixes,
        "mean_agreeing_prefix": statistics.fmean(prefixes) if prefixes else 0.0,
        "tokens_per_prompt": len(want[0]) if want else 0,
    }


def prompts_for(seed: int, n: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


# --------------------------------------------------------------------------- kvtier


async def kvtier_greedy(addresses: list[str], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kvtier.compute_client import ComputeClient

    client = ComputeClient(addresses, TOKEN)
    try:
        outs = []
        for p in prompts:  # one at a time, as HF runs them
            req = client.request(prompt_token_ids=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            outs.append((await client.complete(req)).token_ids)
        return outs
    finally:
        await client.close()


async def kvtier_serve(addresses: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    from kvtier.compute_client import ComputeClient

    client = ComputeClient(addresses, TOKEN)
    ttfts: list[float] = []

    async def one(p: list[int]) -> int:
        t0 = time.perf_counter()
        n = 0
        req = client.request(prompt_token_ids=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for reply in client.stream(req):
            if reply.token_ids and n == 0:
                ttfts.append(time.perf_counter() - t0)
            n += len(reply.token_ids)
        return n

    try:
        # Warm each replica (Triton compiles, first allocations) on prompts the workload does not use.
        await asyncio.gather(*(one([7] * len(prompts[0])) for _ in range(2 * len(addresses))))
        ttfts.clear()
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t
    finally:
        await client.close()
    return {
        "wall_s": wall,
        "output_tokens": sum(counts),
        "output_tokens_per_s": sum(counts) / wall,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
    }


def start_stack(a: argparse.Namespace, model_dir: Path, run_dir: Path):
    from kvtier.cli.stack import LocalStack

    stack = LocalStack(
        run_dir,
        [
            *("--model", str(model_dir), "--swap-space", "4" if a.device == "cuda" else "0.1"),
            *(
                ("--backend", "cuda", "--memory-fraction", str(a.memory_fraction))
                if a.device == "cuda"
                else ("--backend", "cpu-shm", "--dtype", "float32", "--kv-cache-space", "0.25")
            ),
            *("--compute-replicas", str(a.replicas), "--log-level", "INFO"),
        ],
        [
            *("--model", str(model_dir), "--max-num-seqs", str(a.max_num_seqs), "--log-level", "INFO"),
            *(() if a.device == "cuda" else ("--device", "cpu")),
        ],
        num_replicas=a.replicas,
        env=dict(os.environ, KVTIER_TOKEN=TOKEN),
    )
    return stack.up()


# --------------------------------------------------------------------------- driver


class Steps:
    def __init__(self, budget_s: float) -> None:
        self.status: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.deadline = time.monotonic() + budget_s

    def run(self, name: str, fn):
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        if time.monotonic() > self.deadline:
            self.status[name] = "SKIPPED: --budget-s spent"
            self.seconds[name] = 0.0
            print(f"   {name}: skipped, budget spent", flush=True)
            return None
        try:
            value = fn()
            self.status[name] = "ok"
            return value
        except Exception as e:  # noqa: BLE001 - one failed step is reported, the others still run
            traceback.print_exc()
            self.status[name] = f"FAILED: {type(e).__name__}: {e}"[:2000]
            return None
        finally:
            self.seconds[name] = round(time.perf_counter() - t, 1)
            print(f"   {name}: {self.status[name][:200]} ({self.seconds[name]} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_stack: no CUDA device (this benchmark runs on a GPU machine; --device cpu checks wiring)")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-stack-"))
    model_dir = work / "model"
    run_dir = work / "run"
    steps = Steps(a.budget_s)
    # An outer timeout's SIGTERM unwinds through the finally blocks: the stack is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (wiring check; float32)"
    report: dict = {"device": device_name, "args": {k: str(v) for k, v in vars(a).items()}}
    built = steps.run("model", lambda: build_model_dir(a, model_dir))
    parity_prompts = prompts_for(a.seed + 1, a.parity_prompts, [5, 16, 33, 64, 100, 250], a.vocab)
    serve_prompts = prompts_for(a.seed + 2, a.requests, [a.prompt_tokens], a.vocab)
    kv_parity = kv_serve = None
    stack = steps.run("stack", lambda: start_stack(a, model_dir, run_dir)) if built else None
    try:
        if stack is not None:
            addresses = stack.compute_addresses
            if "parity-bf16" in a.steps:
                kv_parity = steps.run(
                    "kvtier-greedy-bf16",
                    lambda: asyncio.run(kvtier_greedy(addresses, parity_prompts, a.parity_tokens)),
                )
            if "serve" in a.steps:
                kv_serve = steps.run(
                    "kvtier-serve", lambda: asyncio.run(kvtier_serve(addresses, serve_prompts, a.max_tokens))
                )
    finally:
        if stack is not None:
            stack.down()
            for log in run_dir.glob("*.log"):
                shutil.copy(log, a.out / log.name)
    if built:
        hf_bf16_steps(a, steps, model_dir, report, parity_prompts, serve_prompts, kv_parity, kv_serve)
        empty_cache()  # the bf16 model went with hf_bf16_steps' frame
        if "parity-fp32" in a.steps:
            fp32_parity_steps(a, steps, model_dir, report, parity_prompts)
    report["model"] = built
    report["steps"] = steps.status
    report["seconds"] = steps.seconds
    (a.out / "gpu_stack.json").write_text(json.dumps(report, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)
    print_headlines(report)
    failed = [k for k, v in steps.status.items() if v != "ok"]
    print(
        f"headline: gpu_stack steps ok {len(steps.status) - len(failed)}/{len(steps.status)}"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}"
    )
    return 1 if failed else 0


def hf_bf16_steps(
    a: argparse.Namespace,
    steps: Steps,
    model_dir: Path,
    report: dict,
    parity_prompts: list[list[int]],
    serve_prompts: list[list[int]],
    kv_parity: list[list[int]] | None,
    kv_serve: dict | None,
) -> None:
    """HF `generate` in bfloat16 (float32 on cpu) on the device: greedy parity against the stack's
    completions (kv_parity) and the serving baselines beside the stack's figures (kv_serve), into
    report. The model lives in this call's frame only: it is freed when the call returns."""
    import torch

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    hf_bf16 = steps.run("hf-load-bf16", lambda: hf_model(model_dir, dtype, a.device))
    if hf_bf16 is not None and kv_parity is not None:
        want = steps.run("hf-greedy-bf16", lambda: hf_greedy(hf_bf16, parity_prompts, a.parity_tokens))
        if want is not None:
            report["parity_bf16"] = agreement(kv_parity, want)
    if hf_bf16 is not None and "serve" in a.steps:
        report["serve"] = {"kvtier": kv_serve}
        report["serve"]["hf_generate_static"] = steps.run(
            "hf-generate-static", lambda: hf_serve_static(hf_bf16, serve_prompts, a.max_tokens)
        )
        report["serve"]["hf_generate_batch"] = steps.run(
            "hf-generate-batch", lambda: hf_serve_continuous(hf_bf16, serve_prompts, a.max_tokens)
        )


def fp32_parity_steps(
    a: argparse.Namespace, steps: Steps, model_dir: Path, report: dict, parity_prompts: list[list[int]]
) -> None:
    """The model runner's float32 Triton path against HF `generate` in float32: must match exactly
    (the step's status says FAILED otherwise)."""
    import torch

    got = steps.run(
        "runner-greedy-fp32",
        lambda: runner_greedy_fp32(model_dir, parity_prompts, a.parity_tokens, a.device),
    )
    hf32 = steps.run("hf-load-fp32", lambda: hf_model(model_dir, torch.float32, a.device)) if got else None
    if hf32 is not None:
        want = steps.run("hf-greedy-fp32", lambda: hf_greedy(hf32, parity_prompts, a.parity_tokens))
        if want is not None:
            report["parity_fp32"] = agreement(got, want)
            if report["parity_fp32"]["exact"] != len(want):
                steps.status["parity-fp32"] = "FAILED: float32 greedy differs from generate"
            else:
                steps.status["parity-fp32"] = "ok"


def print_headlines(report: dict) -> None:
    if report.get("model"):
        print(f"headline: model {report['model']['params'] / 1e9:.3f}B params on {report['device']}")
    for key, what in (
        ("parity_bf16", "bf16, kvtier stack (replicas over gRPC, paged pool)"),
        ("parity_fp32", "fp32, the model runner's Triton path in process"),
    ):
        p = report.get(key)
        if p:
            print(
                f"headline: greedy parity {what} vs HF generate: {p['exact']}/{p['prompts']} prompts "
                f"identical over {p['tokens_per_prompt']} tokens; mean agreeing prefix "
                f"{p['mean_agreeing_prefix']:.1f} tokens"
            )
    serve = report.get("serve") or {}
    kv = serve.get("kvtier")
    if kv:
        parts = [f"kvtier {kv['output_tokens_per_s']:.0f} tok/s (TTFT p50 {kv['ttft_p50_s'] or 0:.3f} s)"]
        for name in ("hf_generate_static", "hf_generate_batch"):
            r = serve.get(name)
            if r:
                ratio = kv["output_tokens_per_s"] / r["output_tokens_per_s"]
                parts.append(f"{name} {r['output_tokens_per_s']:.0f} tok/s (kvtier {ratio:.2f}x)")
        print(
            f"headline: serving throughput, {kv['output_tokens']} output tokens, same requests: "
            + "; ".join(parts)
        )


if __name__ == "__main__":
    sys.exit(main())
