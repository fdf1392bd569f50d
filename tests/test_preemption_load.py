"""Preemption under a sustained overload (issue 23): bounded per request, no swap thrash, and one
tenant's quota never preempts another tenant.

A real cache service (a pool far too small for the load, a host tier, a quota for tenant
"evil"), the replica-side scheduler and model in this process over RemoteCache, as a replica
runs them. An observer records every preemption the scheduler makes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import pytest
from servers import TOKEN, ModuleLoop, cache_service

from kvtier.cache_client import CacheClient
from kvtier.cache_errors import TenantLimited
from kvtier.computesvc.admission import MAX_QUOTA_RETRY_S
from kvtier.computesvc.model import ModelRunner, load_model
from kvtier.computesvc.observer import SchedulerObserver
from kvtier.computesvc.remote_cache import RemoteCache
from kvtier.computesvc.request import Request
from kvtier.computesvc.sampling import SamplingParams
from kvtier.computesvc.scheduler import Scheduler, SchedulerConfig
from kvtier.pool import attach_pool
from kvtier.sequence_types import AllocateItem

LOOP = ModuleLoop()
EVIL_QUOTA = 20  # blocks of 16 tokens


class Recorder(SchedulerObserver):
    """Every preemption: (request id, tenant, reason, mode done, steps since its last swap-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.preempted: list[tuple[str, str, str, str, int]] = []

    def on_preempted(self, span, victim, swapped_bytes, decision) -> None:
        super().on_preempted(span, victim, swapped_bytes, decision)
        mode = "recompute" if swapped_bytes is None else "swap"
        self.preempted.append(
            (victim.request_id, victim.tenant, decision.reason, mode, decision.victim.resident_steps)
        )


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("preemption")
    quotas = run_dir / "quotas.json"
    quotas.write_text(
        json.dumps({"tenants": {"evil": {"keys": ["sk-evil-0123456789abcdef"], "max_blocks": EVIL_QUOTA}}})
    )
    args = ["--num-blocks", "48", "--swap-space", "0.01", "--lease-ttl", "30", "--tenant-quotas", str(quotas)]
    with cache_service(run_dir, *args) as svc:
        yield svc


def run_load(service, loaded, policy: str, requests, stop=None, config=None, later=None, observer=None):
    """Run `requests` ((id, tenant, prompt, max_tokens), added in order; those in `later`, id ->
    step, at that step) to the end on one scheduler with `policy` (and `config`'s other
    fields), or until `stop(recorder)` (then every sequence is freed): their outputs by id,
    and the recorder (`observer`, else a new Recorder)."""
    later = later or {}

    async def scenario():
        client = CacheClient.connect(service.address, TOKEN, aio=True)
        await client.attach(f"load-{policy}", loaded.shape.fingerprint)
        pool = attach_pool(client.pool)
        beat = asyncio.ensure_future(client.heartbeat_forever())
        recorder = observer or Recorder()
        scheduler = Scheduler(
            ModelRunner(loaded.model, pool.tensor, client.pool.block_size),
            RemoteCache(client),
            loaded.tokenizer,
            loaded.eos_token_ids,
            dataclasses.replace(config or SchedulerConfig(max_num_seqs=16), preemption_policy=policy),
            observer=recorder,
        )
        reqs = [
            Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), tenant=tenant)
            for rid, tenant, prompt, n in requests
        ]
        for req in reqs:
            if req.request_id not in later:
                scheduler.add(req)
        steps = 0
        while scheduler.has_work or steps <= max(later.values(), default=0):
            for req in reqs:
                if later.get(req.request_id) == steps:
                    scheduler.add(req)
            if stop is not None and stop(recorder):
                await scheduler._abandon_all(RuntimeError("stopped by the test"))
                break
            await scheduler.step()
            steps += 1
            assert steps < 20_000, "the load made no progress"
        beat.cancel()
        await client.close()
        scheduler = None  # its model runner holds the last view of the pool: close the mapping after it
        pool.close()
        return {r.request_id: r.output_token_ids for r in reqs}, recorder

    return LOOP.run(scenario(), 300)


def prompt(k: int, n: int = 24) -> list[int]:
    return [1 + (k * 31 + j * 7) % 250 for j in range(n)]


def test_preemptions_per_request_are_bounded_and_swapped_in_sequences_stay_a_while(service, loaded, caplog):
    # 10 sequences of 24 + 150 tokens (11 blocks each) on a 48-block pool: at most 4 at once.
    load = [(f"r{k}", "", prompt(k), 150) for k in range(10)]
    with caplog.at_level(logging.DEBUG, logger="kvtier.compute"):
        outputs, cost = run_load(service, loaded, "cost", load)
    # Each decision and its inputs are in a debug line (and the `preempt` span's attributes).
    decided = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempting request")]
    assert len(decided) == len(cost.preempted), decided
    assert all("policy=cost" in line and "recompute_s=" in line and "swap_s=" in line for line in decided)
    reference, newest = run_load(service, loaded, "newest", load)
    per_request = {rid: sum(1 for p in cost.preempted if p[0] == rid) for rid, *_ in load}
    print("preemptions per request, cost:", per_request)
    print("newest:", {rid: sum(1 for p in newest.preempted if p[0] == rid) for rid, *_ in load})
    assert cost.preempted, "the load never preempted: make the pool smaller"
    config = SchedulerConfig()
    forced = [p for p in cost.preempted if p[2] == "forced"]
    assert max(per_request.values()) <= config.max_preemptions + len(forced), per_request
    assert not forced, cost.preempted
    # A sequence swapped back in is not swapped out again within min_resident_steps steps.
    assert all(p[4] >= config.min_resident_steps for p in cost.preempted), cost.preempted
    assert cost.stats.preemptions_swap + cost.stats.preemptions_recompute == len(cost.preempted)
    assert sum(cost.stats.preemptions_by_reason.values()) == len(cost.preempted)
    # Preemption never changes what a greedy sequence generates.
    assert outputs == reference
    assert all(len(tokens) == 150 for tokens in outputs.values())


def test_a_tenants_quota_preempts_only_its_own_sequences(service, loaded, caplog):
    # evil (quota 20 blocks) sends 5 long requests, then acme 2; the pool (48) holds acme's 2
    # and evil's quota, so only evil's quota ever refuses room.
    load = [(f"evil{k}", "evil", prompt(k), 120) for k in range(5)]
    load += [(f"acme{k}", "acme", prompt(50 + k), 120) for k in range(2)]
    with caplog.at_level(logging.INFO, logger="kvtier.compute"):
        outputs, cost = run_load(service, loaded, "cost", load)
    print("cost:", cost.preempted)
    assert cost.preempted, "evil's quota never refused room: raise its load"
    assert all(tenant == "evil" for _, tenant, *_ in cost.preempted), cost.preempted
    # Its quota counts the host tier too: freeing (recompute) gives evil room, a swap would not.
    assert all(mode == "recompute" for *_, mode, _ in cost.preempted), cost.preempted
    # And the replica's log says so, not that a recompute was cheaper than a swap.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempted request")]
    assert len(lines) == len(cost.preempted), lines
    assert all(
        line.endswith("(tenant): will recompute (swap not allowed: tenant quota)") for line in lines
    ), lines
    quiet, _ = run_load(service, loaded, "cost", load[5:])
    assert {rid: outputs[rid] for rid in quiet} == quiet
    assert all(len(tokens) == 120 for tokens in outputs.values())
    # The old rule preempts the newest sequence of any tenant: acme's, for evil's quota (and
    # its swaps never give evil room, so it is stopped there).
    _, newest = run_load(
        service, loaded, "newest", load, stop=lambda rec: any(p[1] == "acme" for p in rec.preempted)
    )
    print("newest:", newest.preempted)
    assert any(tenant == "acme" for _, tenant, *_ in newest.preempted), newest.preempted


def test_a_quota_refusal_names_its_tenant_and_preempts_only_it_though_it_holds_least_here(service, loaded):
    # Another replica's lease holds 14 of evil's 20 blocks, so evil's one sequence here is refused
    # at 6 blocks while acme's, holding far more here, prefills (cheap to recompute yet): the
    # refusal names no pool shortage and evil holds less than its share here, so only the
    # cache's QuotaFailure tells this replica that the refusal is evil's own.
    elsewhere = CacheClient.connect(service.address, TOKEN, timeout_s=10.0)
    try:
        elsewhere.attach("elsewhere")
        held = elsewhere.allocate([AllocateItem([7] * (16 * 14), tenant_salt="e", tenant="evil")])
        with pytest.raises(TenantLimited) as refused:
            elsewhere.allocate([AllocateItem([8] * (16 * 7), tenant_salt="f", tenant="evil")])
        assert refused.value.tenant == "evil", refused.value
        assert refused.value.reason == ""  # not EXCEEDS_LIMIT: it fits once evil's own sequences finish
        load = [("evil0", "evil", prompt(1, 80), 100), ("acme0", "acme", prompt(60, 400), 20)]
        _, cost = run_load(
            service,
            loaded,
            "cost",
            load,
            stop=lambda rec: bool(rec.preempted),
            config=SchedulerConfig(max_num_batched_tokens=16),  # acme prefills 16 tokens a step
            later={"acme0": 12},  # evil is refused at its 96th token, ~step 17
        )
        print("cost:", cost.preempted)
        assert cost.preempted and all(p[1:3] == ("evil", "tenant") for p in cost.preempted), cost.preempted
        elsewhere.free([s.sequence_id for s in held])
    finally:
        elsewhere.close()


class AllocateRecorder(Recorder):
    """Also: when each Allocate and Free was called (step, monotonic s), and when each request was
    admitted (the Allocates made by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocates: list[float] = []
        self.free_steps: list[int] = []
        self.admitted: dict[str, tuple[int, int, float]] = {}  # id -> (step, Allocates so far, when)

    def on_cache_call(self, method: str) -> None:
        super().on_cache_call(method)
        if method == "allocate":
            self.allocates.append(time.monotonic())
        elif method == "free":
            self.free_steps.append(self.stats.steps)

    def on_admitted(self, req, num_cached_tokens: int) -> None:
        super().on_admitted(req, num_cached_tokens)
        self.admitted[req.request_id] = (self.stats.steps, len(self.allocates), time.monotonic())


def test_a_request_waiting_on_its_tenants_quota_is_not_retried_every_step(service, loaded):
    # evil0 (192 + 60 tokens: 17 blocks at most) holds most of evil's 20-block quota, so evil1
    # (128 tokens: 9 blocks) waits until evil0 finishes, while acme0 decodes beside them. Each
    # refused Allocate costs every sequence a step's time: the wait must not send one a step.
    load = [("evil0", "evil", prompt(0, 192), 60), ("acme0", "acme", prompt(1), 150)]
    load.append(("evil1", "evil", prompt(2, 128), 8))
    recorder = AllocateRecorder()
    outputs, _ = run_load(service, loaded, "cost", load, later={"evil1": 1}, observer=recorder)
    assert not recorder.preempted, recorder.preempted
    assert all(len(outputs[rid]) == n for rid, _, _, n in load), {k: len(v) for k, v in outputs.items()}
    admitted_step, allocates, admitted_at = recorder.admitted["evil1"]
    # The first Allocate admitted evil0 and acme0; the last one evil1; those between were refused.
    refused = allocates - 2
    waited_s = admitted_at - recorder.allocates[1]
    print(f"evil1 waited {waited_s:.2f}s: {refused} Allocates refused over {admitted_step} steps")
    assert recorder.admitted["evil0"][0] == recorder.admitted["acme0"][0] == 1
    # Retried after 0.05 s, doubling up to 0.5 s (computesvc.admission.QUOTA_RETRY_S), not each step.
    assert refused <= 5 + 2 * waited_s, (refused, waited_s, admitted_step)
    # ... and admitted at the step after evil0 finished and freed its blocks (the first Free).
    assert admitted_step == recorder.free_steps[0] + 1, (admitted_step, recorder.free_steps)


def test_a_tenant_waiting_on_blocks_another_replica_holds_is_retried_at_a_bounded_interval(service, loaded):
    # Another lease holds 14 of evil's 20 blocks, so evil0 (128 tokens: 9 blocks) waits while
    # acme0 decodes; that lease frees them at step 40. Nothing here tells this scheduler: its
    # retries, at most MAX_QUOTA_RETRY_S apart, find the room.
    elsewhere = CacheClient.connect(service.address, TOKEN, timeout_s=10.0)
    freed_at: list[float] = []
    try:
        elsewhere.attach("elsewhere")
        held = elsewhere.allocate([AllocateItem([7] * (16 * 14), tenant_salt="e", tenant="evil")])

        def free_at_step_40(rec) -> bool:
            if rec.stats.steps >= 40 and not freed_at:
                elsewhere.free([s.sequence_id for s in held])
                freed_at.append(time.monotonic())
            return False

        load = [("acme0", "acme", prompt(1), 150), ("evil0", "evil", prompt(2, 128), 8)]
        recorder = AllocateRecorder()
        outputs, _ = run_load(service, loaded, "cost", load, stop=free_at_step_40, observer=recorder)
    finally:
        elsewhere.close()
    assert all(len(outputs[rid]) == n for rid, _, _, n in load)
    step, allocates, admitted_at = recorder.admitted["evil0"]
    late_s = admitted_at - freed_at[0]
    print(f"evil0 admitted at step {step}, {late_s:.2f}s after the free, {allocates - 2} Allocates refused")
    assert step > 40 and late_s < MAX_QUOTA_RETRY_S + 1.0, (step, late_s)
    assert allocates - 2 <= 5 + 2 * (admitted_at - recorder.allocates[0]), allocates
