"""A tenant flooding past its quota does not preempt, stall or slow another tenant (issue 23).

The issue's flood, scaled down: real processes (a cache service with tenant quotas, two compute
replicas taking client API keys). "evil" (capped at 24 blocks of a 96-block pool) sends 8 long
greedy requests; once it holds its quota, "acme" (uncapped) sends 3 and evil one that can never
fit its quota. acme's streams all finish with the tokens of a quiet run, no replica preempts an
acme sequence (the pool holds acme's and evil's quota: only evil's quota is ever short), and the
request over evil's quota is refused in well under a second.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time

import grpc
import pytest
from servers import ModuleLoop, cache_stats, child_env, greedy_request, local_stack, wait_until

from kvtier import status
from kvtier.compute_client import ComputeClient
from kvtier.gateway.errors import from_grpc

pytestmark = [pytest.mark.timeout(600)]

LOOP = ModuleLoop()
EVIL_KEY = "sk-evil-" + secrets.token_hex(12)
ACME_KEY = "sk-acme-" + secrets.token_hex(12)
EVIL_QUOTA = 24  # blocks of 16 tokens
KEYS = {"tenants": {"evil": {"keys": [EVIL_KEY], "max_blocks": EVIL_QUOTA}, "acme": {"keys": [ACME_KEY]}}}


def prompt(k: int, n: int = 40) -> list[int]:
    return [1 + (k * 37 + j * 11) % 250 for j in range(n)]


ACME = [greedy_request(prompt(100 + k), 48, request_id=f"acme-{k}") for k in range(3)]
EVIL = [greedy_request(prompt(k), 100, request_id=f"evil-{k}") for k in range(8)]
# 16 * 24 + 8 tokens: 25 blocks, one more than evil's quota.
OVER_QUOTA = greedy_request(prompt(999, 16 * EVIL_QUOTA + 8), 4, request_id="evil-over")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("flood")
    keys = run_dir / "api-keys.json"
    keys.write_text(json.dumps(KEYS))
    cache_args = ["--num-blocks", "96", "--swap-space", "0.01", "--tenant-quotas", str(keys)]
    with local_stack(run_dir, cache_args, ["--api-keys", str(keys)], 2, child_env(run_dir)) as s:
        yield s


async def complete(stack, key: str, request):
    client = ComputeClient(stack.compute_addresses, key)
    try:
        return await client.complete(request)
    finally:
        await client.close()


def evil_blocks(stack) -> int:
    return next((t.num_blocks for t in cache_stats(stack).tenants if t.tenant == "evil"), 0)


def test_a_flooding_tenant_never_preempts_stalls_or_slows_another(stack):
    async def all_acme():
        return await asyncio.gather(*(complete(stack, ACME_KEY, r) for r in ACME))

    quiet = LOOP.run(all_acme(), 300)
    logs_before = [len(r.log()) for r in stack.replicas]

    async def flood():
        evil = [asyncio.ensure_future(complete(stack, EVIL_KEY, r)) for r in EVIL]
        deadline = time.monotonic() + 120
        while evil_blocks(stack) < EVIL_QUOTA - 4:  # evil holds (about) its quota
            assert time.monotonic() < deadline, "evil never reached its quota"
            await asyncio.sleep(0.05)
        acme = asyncio.ensure_future(all_acme())
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await complete(stack, EVIL_KEY, OVER_QUOTA)
        refused_after = time.monotonic() - started
        done = await acme
        for task in evil:  # the flood has done its part: its clients go away
            task.cancel()
        await asyncio.gather(*evil, return_exceptions=True)
        return done, refused.value, refused_after

    done, refusal, refused_after = LOOP.run(flood(), 400)
    assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert "quota" in refusal.details() and "can never fit" in refusal.details(), refusal.details()
    assert status.reason_of(refusal) == status.EXCEEDS_LIMIT  # so the gateway answers a 4xx naming it
    http = from_grpc(refusal)
    assert http.status == 400 and "quota" in http.info.message, (http.status, http.info)
    assert refused_after < 1.0, f"refused after {refused_after:.2f}s"
    for k, (calm, busy) in enumerate(zip(quiet, done, strict=True)):
        assert busy.finish_reason == "length" and busy.token_ids == calm.token_ids, f"acme-{k}"
    logs = "".join(r.log()[n:] for r, n in zip(stack.replicas, logs_before, strict=True))
    preempted = re.findall(r"preempted request (\S+) \((\w+)\)", logs)
    assert any(rid.startswith("evil-") for rid, _ in preempted), "the flood never preempted: flood harder"
    assert not [p for p in preempted if p[0].startswith("acme-")], preempted
    wait_until(lambda: cache_stats(stack).num_sequences == 0, 30, "every sequence freed")
