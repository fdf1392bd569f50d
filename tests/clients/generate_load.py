"""A Generate load client, run as its own spawned process by tests/test_reliability.py and
bench/soak.py (multiprocessing "spawn": a fresh interpreter, never a fork of the test).

It imports no torch (kvtier.compute_client only), so 64 of them stay light. Each process says
it is ready, waits for the common start signal, then sends greedy Generate requests one after
the other through `ComputeClient` (failover across the replicas) until its time is up, and
puts one `LoadResult` dict on the results queue.

Prompts share a 32-token system prefix (two full blocks: prefix hits across clients and
replicas) followed by a suffix unique to the client, cycling through `distinct_prompts` per
client. Greedy decoding makes a repeated prompt's completion a check of the last one: a
different answer (WRONG_TOKENS) means some K/V the request read was not what it wrote.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

BOS = 256  # the built-in tiny model's bos token id (kvtier.model_spec.TINY_LLAMA_CONFIG)
SYSTEM_PREFIX = [BOS, *range(1, 32)]


@dataclass
class LoadSpec:
    addresses: list[str]
    token: str
    duration_s: float
    max_tokens: int = 6
    suffix_tokens: int = 8
    request_timeout_s: float = 30.0  # a request not finished by then counts as HUNG
    distinct_prompts: int = 4  # per client; each repeat must get the same greedy tokens


@dataclass
class LoadResult:
    client: int
    served: int = 0
    tokens: int = 0
    cached_prompt_tokens: int = 0
    # status code name (or HUNG / BAD_REPLY / WRONG_TOKENS / exception type) -> count
    errors: dict[str, int] = field(default_factory=dict)
    first_error: str = ""
    # time.monotonic() (one clock for every process on the host) when each request was served
    done_at: list[float] = field(default_factory=list)


def prompt_of(client: int, i: int, suffix_tokens: int) -> list[int]:
    """The system prefix plus a suffix unique to (client, request number)."""
    return SYSTEM_PREFIX + [(client * 31 + i * 7 + k) % 256 for k in range(suffix_tokens)]


async def generate_until(spec: LoadSpec, client_index: int, stop_at: float) -> LoadResult:
    import grpc

    from kvtier.compute_client import ComputeClient

    # Each client starts on a different replica, then round-robins (ComputeClient's failover order).
    k = client_index % len(spec.addresses)
    client = ComputeClient(spec.addresses[k:] + spec.addresses[:k], spec.token)
    result = LoadResult(client_index)
    errors: Counter[str] = Counter()
    first_answer: dict[int, list[int]] = {}  # prompt number -> the tokens it got the first time
    i = 0
    try:
        while time.monotonic() < stop_at:
            which = i % spec.distinct_prompts
            request = ComputeClient.request(
                prompt_token_ids=prompt_of(client_index, which, spec.suffix_tokens),
                max_tokens=spec.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                request_id=f"load-{client_index}-{i}",
            )
            i += 1
            try:
                done = await asyncio.wait_for(client.complete(request), spec.request_timeout_s)
            except grpc.aio.AioRpcError as e:
                kind, message = e.code().name, e.details()
            except TimeoutError:
                kind, message = "HUNG", f"{request.request_id} not done after {spec.request_timeout_s}s"
            except Exception as e:  # noqa: BLE001 - every failure is counted, none is hidden
                kind, message = type(e).__name__, str(e)
            else:
                expected = first_answer.setdefault(which, done.token_ids)
                if done.token_ids != expected:
                    kind = "WRONG_TOKENS"
                    message = f"{request.request_id}: {done.token_ids} after {expected} for the same prompt"
                elif done.finish_reason == "length" and len(done.token_ids) == spec.max_tokens:
                    result.served += 1
                    result.tokens += len(done.token_ids)
                    result.cached_prompt_tokens += done.cached_prompt_tokens
                    result.done_at.append(time.monotonic())
                    continue
                else:
                    kind = "BAD_REPLY"
                    message = (
                        f"{request.request_id}: {done.finish_reason!r} after {len(done.token_ids)} tokens"
                    )
            errors[kind] += 1
            result.first_error = result.first_error or f"{kind}: {message}"
            await asyncio.sleep(0.1)  # back off, as a real client would, instead of spinning on errors
    finally:
        await client.close()
    result.errors = dict(errors)
    return result


def run(spec: LoadSpec, client_index: int, ready, go, results) -> None:
    """Process entry point: import, report ready, wait for `go`, load, put the result dict."""
    import kvtier.compute_client  # noqa: F401 - pay the import before the clock starts

    ready.release()
    go.wait()
    stop_at = time.monotonic() + spec.duration_s
    try:
        result = asyncio.run(generate_until(spec, client_index, stop_at))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about it
        result = LoadResult(client_index, errors={type(e).__name__: 1}, first_error=repr(e))
    results.put(asdict(result))


def start_clients(ctx, spec: LoadSpec, num_clients: int, ready_timeout_s: float = 120.0):
    """Spawn `num_clients` load processes and wait until all are ready; returns (procs, go, results)."""
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=run, args=(spec, k, ready, go, results), name=f"load-{k}", daemon=True)
        for k in range(num_clients)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + ready_timeout_s
    for _ in procs:
        if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            for p in procs:
                p.kill()
            raise TimeoutError(f"{num_clients} load clients not ready after {ready_timeout_s:.0f}s")
    return procs, go, results


def collect(procs, results, timeout_s: float) -> list[dict]:
    """The result dict of every client (a missing one is reported as an error), then reap them."""
    out = []
    deadline = time.monotonic() + timeout_s
    for _ in procs:
        try:
            out.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - queue.Empty: a client died or hung
            break
    seen = {r["client"] for r in out}
    for k, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
        if k not in seen:
            out.append(asdict(LoadResult(k, errors={"NO_RESULT": 1}, first_error=f"exit code {p.exitcode}")))
    return out
