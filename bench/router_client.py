"""The client side of ``bench/router.py``: one streamed completion timed, and the two
measurements taken on the quiet nodes before the policies run: a probe (what a hit saves) and
the calibration of the nodes' capacity (what sets the offered load)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

CALIBRATION_BATCHES = 3  # closed-loop batches measuring the nodes' all-miss capacity
CALIBRATION_REQUESTS = 16  # cold requests per batch
CALIBRATION_PER_NODE = 2  # of them open at once per node


@dataclass
class Result:
    ttft_s: float
    cached: int
    prompt: int
    error: str = ""
    rid: str = ""  # the completion id (the gateway's DEBUG route line names it)
    chat: int = 0
    turn: int = 0
    sent_s: float = 0.0  # when it was sent, s from the policy's start
    end_s: float = 0.0  # when its stream ended, same clock


async def one(http, url: str, prompt: list[int], max_tokens: int, salt: str) -> Result:
    from http_api import JSON_HEADERS, completion_body

    body = json.dumps(completion_body(prompt, max_tokens, salt)).encode()
    t0 = time.perf_counter()
    ttft, rid = 0.0, ""
    async with http.post(f"{url}/v1/completions", data=body, headers=JSON_HEADERS) as reply:
        if reply.status != 200:
            return Result(0.0, 0, len(prompt), f"HTTP {reply.status}: {(await reply.read())[:200]!r}")
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
                rid = json.loads(line[6:]).get("id", "")
            if b'"error"' in line:
                return Result(ttft, 0, len(prompt), json.loads(line[6:])["error"]["message"], rid)
            if b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                return Result(ttft, cached, usage["prompt_tokens"], rid=rid)
    return Result(ttft, 0, len(prompt), "the stream ended without usage", rid)


async def probe(url: str, args: argparse.Namespace, rounds: int = 3) -> tuple[float, float]:
    """Median TTFT (ms) of a system prompt + question sent cold, then sent again (a hit), one
    request at a time on the quiet nodes: what a hit saves, without queueing."""
    import aiohttp

    rng = random.Random(-1)
    cold, warm = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(rounds):
            prompt = [1 + rng.randrange(250) for _ in range(args.system_tokens + args.question_tokens)]
            for times in (cold, warm):
                r = await one(http, url, prompt, args.max_tokens, "probe")
                if r.error:
                    raise RuntimeError(f"probe: {r.error}")
                times.append(1000 * r.ttft_s)
    return statistics.median(cold), statistics.median(warm)


async def calibrate(url: str, args: argparse.Namespace) -> list[float]:
    """The nodes' capacity for requests that all miss, in requests/s, measured CALIBRATION_BATCHES
    times: each a closed loop of CALIBRATION_REQUESTS distinct cold prompts (system prompt +
    question, --max-tokens new tokens), CALIBRATION_PER_NODE per node open at once (the gateway
    spreads requests no node holds evenly). A batch's rate counts only the completions while
    every slot is busy (the first and last round are ramp-up and drain)."""
    import aiohttp

    rng = random.Random(-2)
    rates = []
    open_at_once = 2 * CALIBRATION_PER_NODE
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(CALIBRATION_BATCHES):
            prompts = [
                [1 + rng.randrange(250) for _ in range(args.system_tokens + args.question_tokens)]
                for _ in range(CALIBRATION_REQUESTS)
            ]
            done: list[float] = []
            await asyncio.gather(
                *(closed_loop(http, url, prompts, args.max_tokens, done) for _ in range(open_at_once))
            )
            steady = done[open_at_once - 1 : len(done) - open_at_once]
            rates.append((len(steady) - 1) / (steady[-1] - steady[0]))
    return rates


async def closed_loop(http, url: str, prompts: list[list[int]], max_tokens: int, done: list[float]) -> None:
    """Send ``prompts`` one after another (popping them: workers share the list) until none is
    left, appending each completion's time to ``done``."""
    while prompts:
        r = await one(http, url, prompts.pop(), max_tokens, "calibrate")
        if r.error:
            raise RuntimeError(f"calibration: {r.error}")
        done.append(time.perf_counter())
