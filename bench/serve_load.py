"""bench/serve.py's load generator: plays a workload's sessions against a system in real time,
records what the client saw of each request and samples the system's KV memory meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from baselines import MemorySample
from serve_workloads import RequestSpec, Session, Workload

SAMPLE_PERIOD_S = 0.05


@dataclass
class RequestRecord:
    """One request as the client saw it (perf_counter seconds)."""

    prompt_len: int
    max_tokens: int
    sent_at: float
    token_times: list[float] = field(default_factory=list)  # one per output token
    cached_prompt_tokens: int = 0
    done_at: float | None = None
    error: str | None = None

    @property
    def decoding(self) -> bool:
        return bool(self.token_times) and self.done_at is None and self.error is None


@dataclass
class RunResult:
    system: str
    workload: str
    rate: float
    records: list[RequestRecord]
    samples: list[MemorySample]
    t0: float
    t_end: float


async def sample_until(
    system, records: list[RequestRecord], samples: list[MemorySample], done: asyncio.Event
):
    while not done.is_set():
        samples.append(await system.sample_memory(records))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_PERIOD_S)


async def send(system, spec: RequestSpec, records: list[RequestRecord]) -> RequestRecord:
    rec = RequestRecord(len(spec.prompt), spec.max_tokens, time.perf_counter())
    records.append(rec)
    try:
        async for reply in system.stream(spec.prompt, spec.max_tokens):
            now = time.perf_counter()
            rec.token_times += [now] * len(reply.token_ids)
            if reply.cached_prompt_tokens is not None:
                rec.cached_prompt_tokens = reply.cached_prompt_tokens
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
    rec.done_at = time.perf_counter()
    return rec


async def run_workload(system, workload: str, rate: float, traffic: Workload) -> RunResult:
    """Send the warm-up, then play the sessions against `system` in real time, sampling its KV memory."""
    for spec in traffic.warmup:
        rec = await send(system, spec, [])
        if rec.error:
            raise RuntimeError(f"{system.name}: warm-up request failed: {rec.error}")
    records: list[RequestRecord] = []
    samples: list[MemorySample] = []
    done = asyncio.Event()
    t0 = time.perf_counter()

    async def play(session: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + session.start_s - time.perf_counter()))
        for k, spec in enumerate(session.turns):
            if k:
                await asyncio.sleep(session.think_s[k - 1])
            rec = await send(system, spec, records)
            if rec.error:
                return

    sampler = asyncio.create_task(sample_until(system, records, samples, done))
    await asyncio.gather(*(play(s) for s in traffic.sessions))
    t_end = time.perf_counter()
    done.set()
    await sampler
    return RunResult(system.name, workload, rate, records, samples, t0, t_end)


async def measure_concurrency(system, burst: list[RequestSpec]) -> dict:
    """Send the whole burst at once; the most sequences holding KV at one time, and any errors."""
    records: list[RequestRecord] = []
    samples: list[MemorySample] = []
    done = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_until(system, records, samples, done))
    await asyncio.gather(*(send(system, spec, records) for spec in burst))
    done.set()
    await sampler
    errors = [x.error for x in records if x.error]
    return {
        "method": "measured: peak of sequences holding KV during a burst",
        "max_concurrent_seqs": max((s.num_seqs for s in samples), default=0),
        "peak_kv_bytes": max((s.used_bytes for s in samples), default=0),
        "num_requests": len(burst),
        "num_errors": len(errors),
        "errors": sorted(set(errors))[:3],
        "duration_s": time.perf_counter() - t0,
        "timeline": [[round(s.t - t0, 4), s.num_seqs, s.used_bytes] for s in samples],
    }
