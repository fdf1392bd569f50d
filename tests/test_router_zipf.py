"""Issue 25's routing test: two nodes, a Zipf workload, and kv-aware routing (the default load
weight) against round-robin and pure prefix routing (load weight 0) over the same nodes.

The effect is made large on purpose, so a busy machine cannot hide it: a random Llama big
enough that prefilling a system prompt costs several times a cached request's whole TTFT, and
pools that each hold 60% of the system prompts. Round-robin sends every prompt to both nodes, so
each pool cycles through all of them and evicts what it will want again; kv-aware routing sends
each prompt where it is cached, so each node keeps its part of the set. Each policy runs its own
prompts (its own cache_salt), one policy after another over the same pools: a warm-up round one
request at a time (not counted), then rounds whose requests all arrive at once, so TTFT is the
wait behind the prefill queued on the node (each replica runs MAX_NUM_SEQS sequences at once)
plus the request's own. Hits (usage.cached_tokens) are the primary signal; TTFT is compared
only with a 2x margin.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from servers import child_env

from kvtier.cli.stack import LocalStack, start, up_side_by_side, wait_gateway
from kvtier.model_spec import TINY_LLAMA_CONFIG

BS = 16
SYSTEM_LEN = 48 * BS  # 768 tokens
QUESTION_LEN = 8
NUM_SYSTEMS = 12
ZIPF = 1.0  # popularity exponent over the system prompts
ROUNDS = 3  # per policy; the first warms its pools and is not counted
MAX_NUM_SEQS = 4  # per replica: the others wait unallocated, so the pool holds 4 in flight at most
POOL_BLOCKS = round(0.6 * NUM_SYSTEMS * SYSTEM_LEN / BS) + MAX_NUM_SEQS  # 60% of the prompts + questions
# Big enough that a system prompt's prefill dwarfs a request's fixed costs on a CPU.
MODEL_SHAPE = {"hidden_size": 384, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 6}
# (name, gateway flags)
POLICIES = (
    ("kv-aware", ["--routing", "kv-aware"]),
    ("round-robin", ["--routing", "round-robin"]),
    ("prefix-only", ["--routing", "kv-aware", "--routing-load-weight", "0"]),
)


def round_counts() -> list[int]:
    """How often each system prompt is asked per round: Zipf popularity, at least once."""
    return [max(1, round(3 / (k + 1) ** ZIPF)) for k in range(NUM_SYSTEMS)]


def system_prompt(s: int) -> list[int]:
    rng = random.Random(s)
    return [TINY_LLAMA_CONFIG["bos_token_id"], *(1 + rng.randrange(250) for _ in range(SYSTEM_LEN - 1))]


def workload(seed: int) -> list[list[list[int]]]:
    """ROUNDS rounds of prompts; each asks every system prompt its round_counts() times, shuffled,
    each time with a question of its own."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(ROUNDS):
        systems = [s for s, n in enumerate(round_counts()) for _ in range(n)]
        rng.shuffle(systems)
        rounds.append(
            [system_prompt(s) + [1 + rng.randrange(250) for _ in range(QUESTION_LEN)] for s in systems]
        )
    return rounds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A seeded-random Llama of MODEL_SHAPE and the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.computesvc.model import seed_weights
    from kvtier.tokenizer import build_byte_tokenizer

    path = tmp_path_factory.mktemp("router-zipf-model")
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **MODEL_SHAPE})
    seed_weights(LlamaForCausalLM(config), seed=0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gateways(model_dir, tmp_path_factory):
    """Two nodes of POOL_BLOCKS blocks (one replica each, one thread) and a gateway per policy."""
    base = tmp_path_factory.mktemp("router-zipf")
    model = ["--model", str(model_dir)]
    cache_args = [*model, "--num-blocks", str(POOL_BLOCKS), "--swap-space", "0", "--host-cache-gib", "0"]
    compute_args = [*model, "--threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS)]
    stacks = [
        LocalStack(
            base / f"node-{i}", cache_args, compute_args, num_replicas=1, env=child_env(base / f"node-{i}")
        )
        for i in range(2)
    ]
    procs = {}
    try:
        up_side_by_side(stacks)
        nodes = []
        for i, stack in enumerate(stacks):
            nodes += ["--node", f"node-{i}@{stack.cache_address}={','.join(stack.compute_addresses)}"]
        for name, flags in POLICIES:
            argv = ["--host", "127.0.0.1", "--port", "0", *model, *nodes, *flags]
            procs[name] = start(f"gateway-{name}", "gateway", argv, "", base, child_env(base / "node-0"))
        yield {name: wait_gateway(proc).address for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()
        for stack in stacks:
            stack.down()


def ask(http: httpx.Client, url: str, prompt: list[int], salt: str) -> tuple[float, int]:
    """One streamed completion: (seconds to its first event, cached prompt tokens)."""
    body = {
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": salt,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = 0.0
    with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft = ttft or time.perf_counter() - t0
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                return ttft, event["usage"]["prompt_tokens_details"]["cached_tokens"]
    raise AssertionError("the stream ended without usage")


def run_policy(url: str, salt: str) -> tuple[list[float], int, int]:
    """The workload through the gateway at ``url``: (TTFTs in s, cached prompt tokens, prompt
    tokens) of the rounds after the warm-up."""
    warm_up, *rounds = workload(seed=0)
    ttfts, cached, total = [], 0, 0
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(len(rounds[0])) as pool:
        for prompt in warm_up:
            ask(http, url, prompt, salt)
        for prompts in rounds:
            for (ttft, hit), prompt in zip(
                pool.map(lambda p: ask(http, url, p, salt), prompts), prompts, strict=True
            ):
                ttfts.append(ttft)
                cached += hit
                total += len(prompt)
    return ttfts, cached, total


def test_kv_aware_routing_beats_round_robin_on_hits_and_ttft_and_keeps_prefix_routings_hits(gateways) -> None:
    figures = {}
    for name, _ in POLICIES:
        ttfts, cached, total = run_policy(gateways[name], f"zipf-{name}")
        ttfts.sort()
        figures[name] = {
            "cached": cached,
            "p50": statistics.median(ttfts),
            "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        }
        print(
            f"{name}: cached {cached} of {total} prompt tokens, TTFT p50 {1000 * figures[name]['p50']:.0f} ms "
            f"p90 {1000 * figures[name]['p90']:.0f} ms"
        )
    kv, rr, prefix = figures["kv-aware"], figures["round-robin"], figures["prefix-only"]
    assert kv["cached"] >= 0.95 * prefix["cached"], (kv, prefix)
    assert kv["cached"] >= 1.25 * rr["cached"], (kv, rr)
    # A 2x slowdown of the machine during one policy's run cannot flip these.
    assert 2 * kv["p50"] < rr["p50"], (kv, rr)
    assert 2 * kv["p90"] < rr["p90"], (kv, rr)
