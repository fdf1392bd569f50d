"""The structured-output run of bench/http_api.py (`--structured`): what the grammar mask costs.

Two kinds of pass over the same stack, the same batch size and prompts, alternating rounds:
- plain alone: every request unconstrained (greedy, EOS ignored, max_tokens new tokens);
- mixed: half of the requests constrained by a `json_schema` response_format (an object holding
  an array of exactly K enum strings, K sized so the JSON ends near max_tokens), half plain.

Each request's decode rate is its streamed tokens after the first over the time from its first
to its last token (client side; TTFT, which queueing and prefill decide, is left out). Reported:
the mean rate of plain requests in mixed passes and of constrained ones, each over the mean rate
of plain requests alone. Targets: plain when mixed >= 0.95x, constrained >= 0.8x. Every
constrained output is checked to parse as JSON valid for its schema (an error otherwise).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

# Five-letter words: every item is 7 bytes quoted, so an output's length is fixed by K.
ITEM = {"type": "string", "enum": ["alpha", "bravo", "delta"]}


def schema_for(max_tokens: int) -> dict:
    """A schema whose outputs plus EOS are at most `max_tokens` byte tokens, as close as fits:
    {"log": [K items]} is 9 + 9K bytes ('{"log": [' + K x '"alpha"' + (K-1) x ', ' + ']}'), so
    constrained requests do about the work of plain ones (max_tokens each)."""
    k = max(1, (max_tokens - 10) // 9)
    return {
        "type": "object",
        "properties": {"log": {"type": "array", "items": ITEM, "minItems": k, "maxItems": k}},
        "required": ["log"],
        "additionalProperties": False,
    }


@dataclass
class Timed:
    """One streamed request: its tokens, the clock at its first and last token, its text."""

    constrained: bool
    tokens: int = 0
    first: float = 0.0
    last: float = 0.0
    text: str = ""
    error: str = ""

    @property
    def rate(self) -> float:
        """Tokens per second after the first token (nan when fewer than 2 tokens)."""
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else float("nan")


def body(prompt: list[int], max_tokens: int, salt: str, schema: dict | None) -> bytes:
    out = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt, "stream": True}
    if schema is None:
        out["ignore_eos"] = True
    else:  # the schema decides the length; room to spare so that every output completes
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "log", "schema": schema}}
        out["max_tokens"] = 2 * max_tokens + 16
    return json.dumps(out).encode()


async def one(http, url: str, payload: bytes, constrained: bool) -> Timed:
    r = Timed(constrained)
    try:
        async with http.post(
            f"{url}/v1/completions", data=payload, headers={"Content-Type": "application/json"}
        ) as reply:
            if reply.status != 200:
                r.error = f"HTTP {reply.status}: {(await reply.read())[:200]!r}"
                return r
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"]["message"]
                    return r
                text = chunk["choices"][0]["text"] if chunk["choices"] else ""
                if text or chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    now = time.perf_counter()
                    r.first, r.last, r.tokens = r.first or now, now, r.tokens + 1
                    r.text += text
    except Exception as e:  # noqa: BLE001 - counted and reported
        r.error = repr(e)
    return r


async def run_pass(http, url, prompts, max_tokens, salt, mixed: bool) -> list[Timed]:
    import asyncio

    schema = schema_for(max_tokens)
    sends = []
    for i, prompt in enumerate(prompts):
        constrained = mixed and i % 2 == 0
        payload = body(prompt, max_tokens, f"{salt}-{i}", schema if constrained else None)
        sends.append(one(http, url, payload, constrained))
    results = await asyncio.gather(*sends)
    for r in results:
        if r.constrained and not r.error:
            try:
                import jsonschema

                jsonschema.validate(json.loads(r.text), schema)
            except Exception as e:  # noqa: BLE001
                r.error = f"constrained output does not validate: {e}: {r.text[:80]!r}"
    return results


async def measure(url: str, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """{"plain_alone": [[Timed] per round], "mixed": [[Timed] per round]}, rounds alternating
    which pass goes first."""
    import aiohttp

    def session():
        # One per pass: connections left idle between passes (the gateway closes them after a
        # few seconds) would fail the next pass's first requests. The decode rate leaves out
        # connecting, which counts in TTFT only.
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=len(prompts) + 8), timeout=aiohttp.ClientTimeout(total=900)
        )

    out: dict[str, list[list[Timed]]] = {"plain_alone": [], "mixed": []}
    async with session() as http:  # compile the schema, load the model's code paths
        await run_pass(http, url, [p[:16] for p in prompts], max_tokens, "warm", mixed=True)
    for r in range(rounds):
        for kind in ("plain_alone", "mixed") if r % 2 == 0 else ("mixed", "plain_alone"):
            t0 = time.perf_counter()
            async with session() as http:
                results = await run_pass(http, url, prompts, max_tokens, f"{kind}-{r}", kind == "mixed")
            out[kind].append(results)
            print(
                f"  round {r} {kind:>11}: {len(results)} requests in {time.perf_counter() - t0:.2f} s",
                flush=True,
            )
    return out


def _mean_rate(results) -> float:
    rates = [r.rate for r in results if not r.error and r.rate == r.rate]
    return statistics.fmean(rates) if rates else float("nan")


def report(raw: dict) -> tuple[str, dict, int]:
    """(the headline, the figures, the error count). Ratios are to plain requests alone; the
    per-round ratios (each mixed pass over the plain pass of its round) show the machine's noise."""
    alone = _mean_rate(r for rnd in raw["plain_alone"] for r in rnd)
    plain_mixed = _mean_rate(r for rnd in raw["mixed"] for r in rnd if not r.constrained)
    constrained = _mean_rate(r for rnd in raw["mixed"] for r in rnd if r.constrained)
    errors = [r.error for kind in raw.values() for rnd in kind for r in rnd if r.error]
    per_round = [
        (
            _mean_rate(r for r in mixed if not r.constrained) / _mean_rate(plain),
            _mean_rate(r for r in mixed if r.constrained) / _mean_rate(plain),
        )
        for plain, mixed in zip(raw["plain_alone"], raw["mixed"], strict=True)
    ]
    s = {
        "plain_alone_tok_per_s": alone,
        "plain_mixed_tok_per_s": plain_mixed,
        "constrained_tok_per_s": constrained,
        "plain_mixed_ratio": plain_mixed / alone,
        "constrained_ratio": constrained / alone,
        "per_round_ratios": per_round,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
    }
    for i, (p, c) in enumerate(per_round):
        print(f"  round {i}: plain mixed / alone {p:.3f}, json_schema / plain alone {c:.3f}")
    met = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    headline = (
        f"headline: per-request decode rate, plain alone {alone:.1f} tok/s; mixed batch: plain {plain_mixed:.1f} "
        f"= {s['plain_mixed_ratio']:.3f}x (target >= 0.95: {met(s['plain_mixed_ratio'] >= 0.95)}), json_schema "
        f"{constrained:.1f} = {s['constrained_ratio']:.3f}x (target >= 0.8: {met(s['constrained_ratio'] >= 0.8)}); "
        f"errors {len(errors)}"
    )
    return headline, s, len(errors)


def mask_cost(vocab: int, max_tokens: int, batch: int, steps: int = 50) -> dict[int, float]:
    """In this process, no model: seconds per step (the least of `steps`) that the replica's mask
    and matcher updates take for a batch of `batch` rows of which 0, 1, half or all are
    constrained by the run's schema ({constrained rows: seconds})."""
    import torch

    from kvtier.computesvc.structured_output import Grammars, advance, mask_logits
    from kvtier.structured_output import Constraint
    from kvtier.tokenizer import build_byte_tokenizer

    grammars = Grammars(build_byte_tokenizer(), vocab, [build_byte_tokenizer().eos_token_id])
    constraint = Constraint.json_schema(schema_for(max_tokens), "response_format")
    gen, out = torch.Generator().manual_seed(0), {}
    for n in sorted({0, 1, batch // 2, batch}):
        states = [grammars.start(constraint, []) if i < n else None for i in range(batch)]
        best = float("inf")
        for _ in range(steps):
            logits = torch.randn(batch, vocab, generator=gen)
            t0 = time.perf_counter()
            masked = mask_logits(logits, states)
            elapsed = time.perf_counter() - t0
            tokens = masked.argmax(-1).tolist()  # stands in for sampling (not timed)
            t0 = time.perf_counter()
            advance(states, tokens, {})
            best = min(best, elapsed + time.perf_counter() - t0)
        out[n] = best
    return out


def run(
    stack, prompts: list[list[int]], max_tokens: int, rounds: int, json_path: str | None, vocab: int
) -> int:
    """Measure on `stack` (a LocalStack with its gateway, not started yet), print the headline
    last. `vocab`: the model's vocabulary (the logits' width), for the in-process mask cost."""
    import asyncio
    from pathlib import Path

    cost = mask_cost(vocab, max_tokens, len(prompts))
    print(
        "mask + matcher update per step, in process, no model (least of 50): "
        + ", ".join(f"{n} of {len(prompts)} rows constrained {1e3 * s:.3f} ms" for n, s in cost.items())
    )
    with stack:
        raw = asyncio.run(measure(stack.gateway.address, prompts, max_tokens, rounds))
    headline, s, errors = report(raw)
    s["mask_cost_s_per_step"] = cost
    if json_path:
        Path(json_path).write_text(json.dumps(s, indent=2))
    print(headline)
    return 0 if errors == 0 else 1
