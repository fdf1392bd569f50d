"""The preemption cost model (computesvc/preemption.py): pure function of named inputs.

Rates are a GPU-like replica's (prefill 20k tokens/s, 2 ms per cache call, 1 GB/s swap) and
blocks are 16 tokens of 8 KiB, unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvtier.computesvc.preemption import (
    FORCED,
    POOL,
    RECOMPUTE,
    SWAP,
    TENANT,
    Candidate,
    Ledger,
    Pressure,
    Rates,
    backoff_s,
    choose_victim,
)

RATES = Rates(prefill_tokens_per_s=20_000, swap_bytes_per_s=1e9, decode_step_s=0.02, call_s=0.002)
PRESSURE = Pressure(block_bytes=8192)


def seq(name: str, tokens: int, generated: int = 0, remaining: int = 100, **kw) -> Candidate:
    """A running sequence of `tokens` computed tokens in whole 16-token blocks."""
    kw.setdefault("arrival", float(len(name)))
    kw.setdefault("tenant", "")
    return Candidate(
        name,
        computed_tokens=tokens,
        num_blocks=-(-tokens // 16),
        generated_tokens=generated,
        remaining_tokens=remaining,
        **kw,
    )


def test_a_long_sequence_is_swapped_and_a_short_one_recomputed():
    long = choose_victim([seq("long", 4000)], RATES, PRESSURE)
    short = choose_victim([seq("short", 16)], RATES, PRESSURE)
    # 4000 tokens: 0.2 s of prefill against 2 x (2 ms + 2 MB at 1 GB/s) = 8 ms of swap.
    assert long.mode == SWAP and long.swap_s < long.recompute_s, long
    assert long.recompute_s == pytest.approx(0.002 + 4000 / 20_000)
    assert long.swap_s == pytest.approx(2 * (0.002 + 250 * 8192 / 1e9))
    # 16 tokens: 2.8 ms of recompute against two cache calls (4 ms) of swap.
    assert short.mode == RECOMPUTE and short.recompute_s < short.swap_s, short
    # Between the two, the cheaper to bring back is the victim, in its own cheaper mode.
    both = choose_victim([seq("long", 4000), seq("short", 16)], RATES, PRESSURE)
    assert both.victim.key == "short" and both.mode == RECOMPUTE and both.reason == POOL
    assert both.cost_s == pytest.approx(short.cost_s)


def test_with_the_host_tier_full_swap_is_not_chosen():
    full = Pressure(block_bytes=8192, host_has_room=False)
    decision = choose_victim([seq("long", 4000)], RATES, full)
    assert decision.mode == RECOMPUTE
    assert decision.cost_s == pytest.approx(decision.recompute_s)  # no progress yet: no other term
    # The newest policy also recomputes then (as the scheduler always did).
    assert choose_victim([seq("long", 4000)], RATES, full, policy="newest").mode == RECOMPUTE


def test_the_progress_term_protects_a_sequence_near_its_end():
    starting = seq("starting", 512, generated=10, remaining=290, arrival=1.0)
    ending = seq("ending", 512, generated=290, remaining=10, arrival=2.0)
    decision = choose_victim([starting, ending], RATES, PRESSURE)
    assert decision.victim.key == "starting", decision
    # Same sizes, so the same cost to bring back: the progress term alone decides.
    ending_alone = choose_victim([ending], RATES, PRESSURE)
    assert ending_alone.progress_s == pytest.approx(0.02 * 290 * 290 / 300)
    assert ending_alone.progress_s > 100 * decision.progress_s
    # The newest policy takes the newest regardless: the one about to finish.
    assert choose_victim([starting, ending], RATES, PRESSURE, policy="newest").victim.key == "ending"


def test_a_tenant_over_its_share_is_cheaper_to_preempt():
    mine = seq("mine", 640, tenant="acme", arrival=1.0)  # 40 blocks
    flood = [seq(f"flood{k}", 640, tenant="evil", arrival=2.0 + k) for k in range(3)]  # 120 blocks
    decision = choose_victim([mine, *flood], RATES, PRESSURE)
    assert decision.victim.tenant == "evil"
    assert decision.fairness == pytest.approx(80 / 120)  # even share 80 of 160 blocks, evil holds 120


def test_a_tenants_own_limit_preempts_only_its_own_sequences_and_frees_them():
    cheap_other = seq("acme", 16, tenant="acme")
    evil = seq("evil-big", 4000, tenant="evil")
    refused = Pressure(block_bytes=8192, refused_tenant="evil")
    decision = choose_victim([cheap_other, evil], RATES, refused)
    assert decision.victim.key == "evil-big" and decision.reason == TENANT
    # Its quota counts the host tier too: a swap would not give the tenant room, a free does.
    assert decision.mode == RECOMPUTE
    # Without the tenant named, the cheapest of all goes.
    assert choose_victim([cheap_other, evil], RATES, PRESSURE).victim.key == "acme"


def test_the_info_line_says_why_a_cheaper_swap_was_not_made_and_metrics_count_it(caplog):
    from kvtier.computesvc.metrics import ComputeMetrics
    from kvtier.computesvc.observer import MetricsObserver
    from kvtier.computesvc.request import Request
    from kvtier.computesvc.sampling import SamplingParams

    long = seq("long", 4000, tenant="evil")  # its swap (8 ms) is far cheaper than its recompute (0.2 s)
    tenant = choose_victim([long], RATES, Pressure(block_bytes=8192, refused_tenant="evil"))
    forced = choose_victim([dataclasses.replace(long, preemptions=3)], RATES, PRESSURE)
    host_full = choose_victim([long], RATES, Pressure(block_bytes=8192, host_has_room=False))
    cheaper = choose_victim([seq("short", 16)], RATES, PRESSURE)
    vllm = choose_victim([long], RATES, PRESSURE, policy="newest-recompute")
    swapped = choose_victim([long], RATES, PRESSURE)
    assert all(d.swap_s < d.recompute_s for d in (tenant, forced, host_full, swapped))
    assert [d.because for d in (tenant, forced, host_full, cheaper, vllm)] == [
        "tenant", "forced", "host_full", "cheaper", "policy"
    ]  # fmt: skip
    assert swapped.mode == SWAP and swapped.because == ""
    metrics = ComputeMetrics()
    observer = MetricsObserver(metrics)
    with caplog.at_level(logging.INFO, logger="kvtier.compute"):
        for k, decision in enumerate((tenant, forced, host_full, cheaper, vllm, swapped)):
            victim = Request(f"v{k}", [1, 2, 3], SamplingParams(max_tokens=4), tenant="evil")
            with observer.preempt_span(victim, decision) as span:
                observer.on_preempted(span, victim, None, decision)  # the last: a SwapOut refused
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempted request")]
    assert lines == [
        "preempted request v0 (tenant): will recompute (swap not allowed: tenant quota)",
        "preempted request v1 (forced): will recompute (swap not allowed: forced)",
        "preempted request v2 (pool): will recompute (swap not allowed: host tier full)",
        "preempted request v3 (pool): will recompute (cheaper than a swap)",
        "preempted request v4 (pool): will recompute (the policy never swaps)",
        "preempted request v5 (pool): will recompute (the host tier refused the swap)",
    ]
    assert observer.stats.recomputed_because == {
        "tenant": 1, "forced": 1, "host_full": 1, "cheaper": 1, "policy": 1, "host_refused": 1
    }  # fmt: skip
    for because in ("tenant", "cheaper", "host_refused"):
        value = metrics.registry.get_sample_value(
            "kvtier_compute_preemptions_recomputed_total", {"because": because}
        )
        assert value == 1, because


def test_guards_pass_over_a_sequence_just_swapped_in_or_preempted_too_often():
    just_in = seq("just_in", 16, resident_steps=1)
    worn = seq("worn", 32, preemptions=3)
    fresh = seq("fresh", 4000)
    decision = choose_victim([just_in, worn, fresh], RATES, PRESSURE)
    assert decision.victim.key == "fresh" and decision.guarded == 2 and decision.candidates == 1
    # All guarded: wait while another sequence can run, else the guards give way.
    assert choose_victim([just_in, worn], RATES, Pressure(block_bytes=8192, can_wait=True)) is None
    forced = choose_victim([just_in, worn], RATES, PRESSURE)
    assert forced.reason == FORCED and forced.victim.key == "just_in"
    assert forced.mode == RECOMPUTE  # a forced swap would come straight back: freed instead


def test_rates_start_from_priors_and_follow_measurements():
    rates = Rates()
    prior = rates.prefill_tokens_per_s
    for _ in range(60):
        rates.observe_prefill(5000, 1.0)
        rates.observe_call(0.004)
        rates.observe_swap(1_000_000, 0.004 + 0.01)  # 1 MB in 10 ms beyond the round trip
    assert prior != 5000 and rates.prefill_tokens_per_s == pytest.approx(5000, rel=1e-3)
    assert rates.call_s == pytest.approx(0.004, rel=1e-3)
    assert rates.swap_bytes_per_s == pytest.approx(1e8, rel=1e-2)
    rates.observe_prefill(0, 0.0)  # nothing measured: nothing changes
    assert rates.prefill_tokens_per_s == pytest.approx(5000, rel=1e-3)


def test_the_ledger_counts_preemptions_and_steps_since_a_swap_in():
    ledger = Ledger()

    class Req:  # any weak-referenceable handle
        pass

    req = Req()
    assert ledger.preemptions(req) == 0 and ledger.resident_steps(req) > 1000
    ledger.preempted(req)
    ledger.host_has_room = False
    ledger.step = 7
    ledger.swapped_in(req)
    ledger.step = 9
    assert ledger.preemptions(req) == 1 and ledger.resident_steps(req) == 2 and ledger.host_has_room
    del req
    assert len(ledger._preemptions) == 0  # a finished request leaves no trace
    # Swapped sequences come back only once the cache has refused no room for a few steps.
    assert ledger.settled(4)
    ledger.refused_at = 8
    assert not ledger.settled(4) and ledger.settled(1)


def test_a_freed_victims_tenant_backs_off_doubling_up_to_a_cap():
    assert [backoff_s(n) for n in (1, 2, 3)] == [0.05, 0.1, 0.2]
    assert backoff_s(20) == 2.0
    # Admission's hold on a tenant its own quota refused: 0.05 s doubling up to 0.5 s.
    assert [backoff_s(n, 0.05, 0.5) for n in (1, 4, 5, 9)] == [0.05, 0.4, 0.5, 0.5]


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"'oldest' is not one of \('cost', 'newest', 'newest-recompute'\)"):
        choose_victim([seq("a", 16)], RATES, PRESSURE, policy="oldest")


def test_metrics_count_preemptions_by_reason_and_mode_from_zero():
    from opentelemetry import trace

    from kvtier.computesvc.metrics import ComputeMetrics
    from kvtier.computesvc.observer import MetricsObserver
    from kvtier.computesvc.request import Request
    from kvtier.computesvc.sampling import SamplingParams

    metrics = ComputeMetrics()

    def count(**labels) -> float:
        return metrics.registry.get_sample_value("kvtier_compute_preemptions_by_reason_total", labels)

    assert count(reason="tenant", mode="recompute") == 0 and count(reason="forced", mode="swap") == 0
    victim = Request("v", [1, 2, 3], SamplingParams(max_tokens=4), tenant="evil")
    decision = choose_victim(
        [seq("v", 3, tenant="evil")], RATES, Pressure(block_bytes=8192, refused_tenant="evil")
    )
    observer = MetricsObserver(metrics)
    with observer.preempt_span(victim, decision) as span:
        observer.on_preempted(span, victim, None, decision)
    assert count(reason="tenant", mode="recompute") == 1
    assert metrics.registry.get_sample_value("kvtier_compute_preemptions_total", {"kind": "recompute"}) == 1
    assert observer.stats.preemptions_by_reason == {("tenant", "recompute"): 1}
    assert isinstance(span, trace.Span)
