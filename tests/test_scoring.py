"""The kv-aware router's pure parts: gateway/scoring.py ranks nodes from named figures, and
gateway/node_load.py measures a node's open work and throughput. No services, no clock."""

from __future__ import annotations

import pytest

from kvtier.gateway.discovery import Node
from kvtier.gateway.index_follower import NodeState, PredictedHit, capped, predicted_hit
from kvtier.gateway.node_load import PRIOR_TOKENS_PER_S, NodeLoad
from kvtier.gateway.scoring import NodeFigures, rank, score
from kvtier.media import medium

PROMPT = 1000  # tokens
FAST = 1000.0  # tokens of work per second


def test_the_score_is_minus_the_expected_time_to_first_token() -> None:
    # 600 cached of 1000, 2000 tokens queued at 1000/s: 2 s of queue + 0.4 s of prefill.
    assert score(NodeFigures(600, 2000, FAST), PROMPT, 1.0, FAST) == pytest.approx(-2.4)
    assert score(NodeFigures(600, 2000, FAST), PROMPT, 0.5, FAST) == pytest.approx(-1.4)
    # The queue at the node's own rate, the prefill at the shared one.
    assert score(NodeFigures(0, 1000, 2 * FAST), PROMPT, 1.0, FAST) == pytest.approx(-1.5)


def test_the_held_prefix_wins_until_the_queue_on_its_node_costs_more_than_it_saves() -> None:
    holder, idle = NodeFigures(800, 0, FAST), NodeFigures(0, 0, FAST)
    assert rank([holder, idle], PROMPT, 1.0, tie=0).order == [0, 1]
    assert rank([holder, idle], PROMPT, 1.0, tie=0).reason == "prefix"
    # 700 tokens queued: 0.7 s + 0.2 s < 1.0 s on the idle node: still the holder.
    assert rank([NodeFigures(800, 700, FAST), idle], PROMPT, 1.0, tie=0).order[0] == 0
    # 1500 tokens queued: 1.7 s > 1.0 s: the request spills to the idle node.
    spilled = rank([NodeFigures(800, 1500, FAST), idle], PROMPT, 1.0, tie=0)
    assert spilled.order == [1, 0] and spilled.reason == "load_spill"
    # Load weight 0: the prefix alone decides, however long the queue.
    assert rank([NodeFigures(800, 10**6, FAST), idle], PROMPT, 0.0, tie=0).reason == "prefix"


def test_a_spill_no_faster_than_staying_does_not_happen() -> None:
    # 850 tokens queued on the holder: 1.05 s to a first token there, 1.0 s on the idle node. As
    # fast within TIE_FRACTION, and the spill would prefill 800 tokens more: the holder keeps it,
    # though it has a request in flight and the idle node none.
    holder, idle = NodeFigures(800, 850, FAST, inflight=1), NodeFigures(0, 0, FAST)
    ranking = rank([idle, holder], PROMPT, 1.0, tie=0)
    assert (ranking.order, ranking.reason) == ([1, 0], "prefix")
    # Clearly faster elsewhere (1.5 s against 1.0 s): it spills.
    assert rank([idle, NodeFigures(800, 1300, FAST, inflight=1)], PROMPT, 1.0, tie=0).reason == "load_spill"


def test_queued_work_costs_more_on_a_slower_node_but_a_noisy_rate_never_outweighs_a_hit() -> None:
    idle = NodeFigures(0, 0, 4 * FAST)
    # 300 tokens queued at 250/s (1.2 s) on the holder: the idle node is faster to a first token.
    assert rank([NodeFigures(800, 300, FAST / 4), idle], PROMPT, 1.0, tie=0).order[0] == 1
    # The same queue at 4000/s (0.08 s): the holder.
    assert rank([NodeFigures(800, 300, 4 * FAST), idle], PROMPT, 1.0, tie=0).order[0] == 0
    # Nothing queued: the hit wins however differently the two rates were measured.
    assert rank([NodeFigures(100, 0, FAST / 20), idle], PROMPT, 1.0, tie=0).order[0] == 0


def test_no_hit_anywhere_is_a_tie_broken_by_requests_in_flight_then_round_robin() -> None:
    a, b = NodeFigures(0, 0, FAST, inflight=2), NodeFigures(0, 0, FAST, inflight=1)
    ranking = rank([a, b], PROMPT, 1.0, tie=0)
    assert ranking.order == [1, 0] and ranking.reason == "tie"
    equal = [NodeFigures(0, 0, FAST), NodeFigures(0, 0, FAST), NodeFigures(0, 0, FAST)]
    assert [rank(equal, PROMPT, 1.0, tie=t).order[0] for t in range(4)] == [0, 1, 2, 0]
    # Throughputs measured a few percent apart are equal: the work still spreads.
    noisy = [NodeFigures(0, 0, FAST), NodeFigures(0, 0, 1.05 * FAST)]
    assert {rank(noisy, PROMPT, 1.0, tie=t).order[0] for t in range(2)} == {0, 1}


def test_node_load_counts_open_work_and_measures_throughput_from_finished_work() -> None:
    load = NodeLoad(_since=0.0)
    assert load.tokens_per_s() == PRIOR_TOKENS_PER_S and load.queue_s() == 0
    load.opened(3000, now=0.0)
    assert load.inflight == 1 and load.queue_s(now=0.0) == pytest.approx(3000 / PRIOR_TOKENS_PER_S)
    # Failed or abandoned work leaves the queue without counting as work done.
    load.closed(3000, finished=False, now=0.0)
    assert (load.inflight, load.outstanding_tokens, load.tokens_per_s()) == (0, 0, PRIOR_TOKENS_PER_S)
    # A node that gets through 500 tokens of work per busy second, back to back for 2 minutes:
    # the prior fades and the measurement takes over.
    t = 0.0
    for _ in range(120):
        load.opened(500, now=t)
        t += 1.0
        load.closed(500, finished=True, now=t)
    assert load.tokens_per_s() == pytest.approx(500, rel=0.1)
    # A minute idle does not change the measurement.
    before = load.tokens_per_s()
    load.opened(10, now=t + 60)
    assert load.tokens_per_s() == pytest.approx(before)


def test_the_work_waiting_on_a_node_is_what_its_measured_rate_has_not_got_through() -> None:
    load = NodeLoad(_since=0.0)
    load.opened(3000, now=0.0)
    # 0.5 s at the prior's rate: that much of the 3000 done, the rest waiting; all done by 3000 / rate.
    assert load.waiting_tokens(now=0.5) == pytest.approx(3000 - 0.5 * PRIOR_TOKENS_PER_S)
    assert load.waiting_tokens(now=3000 / PRIOR_TOKENS_PER_S + 0.5) == 0
    # A second request opened at 1 s waits behind what is left of the first.
    load.opened(1000, now=1.0)
    assert load.waiting_tokens(now=1.0) == pytest.approx(3000 - PRIOR_TOKENS_PER_S + 1000, rel=0.01)
    # The first one ends: its work leaves the estimate; the second's is left, less what was done.
    load.closed(3000, finished=True, now=1.0)
    assert load.outstanding_tokens == 1000 and 0 < load.waiting_tokens(now=1.0) <= 1000
    load.closed(1000, finished=True, now=1.2)
    assert load.waiting_tokens(now=5.0) == 0 and load.queue_s(now=5.0) == 0


def test_a_host_or_disk_hit_saves_a_fraction_of_a_device_hit() -> None:
    # 600 tokens held: on the device they save 0.6 s of prefill, on the host 0.8 of that, on disk
    # 0.7 (1 - each medium's price in kvtier.media's table).
    HOST_TOKEN_VALUE, DISK_TOKEN_VALUE = medium("host").token_value, medium("disk").token_value
    device, host, disk = (
        NodeFigures(600, 0, FAST),
        NodeFigures(0, 0, FAST, below_tokens={"host": 600}),
        NodeFigures(0, 0, FAST, below_tokens={"disk": 600}),
    )
    assert score(device, PROMPT, 1.0, FAST) == pytest.approx(-0.4)
    assert score(host, PROMPT, 1.0, FAST) == pytest.approx(-(1.0 - HOST_TOKEN_VALUE * 0.6))
    assert score(disk, PROMPT, 1.0, FAST) == pytest.approx(-(1.0 - DISK_TOKEN_VALUE * 0.6))
    assert 0 < DISK_TOKEN_VALUE < HOST_TOKEN_VALUE < 1
    miss = NodeFigures(0, 0, FAST)
    # Same prefix held: device beats host beats disk beats a miss, whatever the candidates' order.
    assert rank([miss, disk, host, device], PROMPT, 1.0, tie=0).order == [3, 2, 1, 0]
    assert rank([device, host, disk, miss], PROMPT, 1.0, tie=0).order == [0, 1, 2, 3]
    ranking = rank([miss, host], PROMPT, 1.0, tie=0)
    assert (ranking.order[0], ranking.reason) == (1, "prefix")
    # A longer prefix on the host beats a shorter one on the device: 800 * 0.8 > 500.
    assert (
        rank(
            [NodeFigures(500, 0, FAST), NodeFigures(0, 0, FAST, below_tokens={"host": 800})], PROMPT, 1.0, 0
        ).order[0]
        == 1
    )
    # Device 300 + host 300 of a prompt vs device 400: 300 + 240 saved against 400.
    mixed = NodeFigures(300, 0, FAST, below_tokens={"host": 300})
    assert rank([NodeFigures(400, 0, FAST), mixed], PROMPT, 1.0, tie=0).order[0] == 1
    # A load spill: the device holder is busy; the host holder wins on load.
    spilled = rank([NodeFigures(600, 3000, FAST), host], PROMPT, 1.0, tie=0)
    assert (spilled.order[0], spilled.reason) == (1, "load_spill")


def test_the_predicted_hit_follows_device_then_host_then_disk_and_is_capped() -> None:
    bs = 16
    state = NodeState(Node("n", "unix:///x", []), cache=None, block_size=bs)  # no calls are made
    chain = [bytes([k]) * 32 for k in range(6)]
    state.hashes.update(chain[:2])
    state.index("host").update([chain[2], chain[4], chain[0]])
    state.index("disk").update([chain[3], chain[2]])
    # Device run 0-1, then host 2 (also on disk: the host serves it), disk 3, host 4; 5 held nowhere.
    assert predicted_hit(state, chain, 6 * bs + 1) == PredictedHit(2 * bs, {"host": 2 * bs, "disk": bs})
    assert predicted_hit(state, chain, 6 * bs + 1).total == 5 * bs
    # The cap (the last prompt token is computed) cuts from the end: 4 * bs + 1 tokens cap at 4 blocks.
    assert predicted_hit(state, chain[:5], 4 * bs + 1) == PredictedHit(2 * bs, {"host": bs, "disk": bs})
    assert predicted_hit(state, chain[:5], 4 * bs) == PredictedHit(2 * bs, {"host": bs})
    assert predicted_hit(state, chain[:2], 2 * bs) == PredictedHit(bs)
    # A block missing on every tier ends the hit; what follows it is useless.
    state.index("disk").discard(chain[3])
    assert predicted_hit(state, chain, 6 * bs + 1) == PredictedHit(2 * bs, {"host": bs})
    # LookupPrefix's per-tier counts (an unsynced node) are capped from the lower tiers' share.
    assert capped(2 * bs, {"host": 2 * bs, "disk": bs}, 4 * bs + 1, bs) == PredictedHit(
        2 * bs, {"host": 2 * bs}
    )
    assert capped(2 * bs, {"host": 2 * bs, "disk": bs}, 3 * bs, bs) == PredictedHit(2 * bs)
    assert capped(4 * bs, {}, 4 * bs, bs) == PredictedHit(3 * bs)
    # Nothing while the block size is unknown.
    state.block_size = 0
    assert predicted_hit(state, chain, 6 * bs + 1) == PredictedHit()


def test_a_request_waits_on_its_node_until_its_first_token_and_its_prefill_sets_the_rate() -> None:
    load = NodeLoad(_since=0.0)
    load.opened(600, now=0.0)
    load.opened(400, now=0.0)
    assert (load.waiting_requests, load.outstanding_tokens) == (2, 1000)
    # The first one's first token after 0.5 s: its work leaves the queue while it decodes on.
    load.started(600, now=0.5)
    assert (load.inflight, load.waiting_requests, load.outstanding_tokens) == (2, 1, 400)
    # Its end changes neither the queue nor the rate: its work counted at its first token.
    rate = load.tokens_per_s()
    load.closed(600, finished=True, started=True, now=5.0)
    assert (load.inflight, load.outstanding_tokens) == (1, 400) and load.tokens_per_s() < rate
    # Time with nothing waiting is not busy time: a minute of decoding only keeps the measured rate.
    load.started(400, now=5.0)
    rate = load.tokens_per_s()
    load.opened(10, now=65.0)
    assert load.inflight == 2 and load.waiting_tokens(now=65.0) == 10
    assert load.tokens_per_s() == pytest.approx(rate)


def test_a_prefill_pays_for_the_requests_it_would_share_a_step_with() -> None:
    # A miss (1000 tokens, 1 s) on a node where two requests wait: 1 s of its own + 1 s for each.
    waited = NodeFigures(0, 0, FAST, waiting_requests=2)
    assert score(waited, PROMPT, 1.0, FAST) == pytest.approx(-3.0)
    # A hit there (100 tokens to prefill) costs them little: 0.1 s each.
    assert score(NodeFigures(900, 0, FAST, waiting_requests=2), PROMPT, 1.0, FAST) == pytest.approx(-0.3)
    # So a miss goes to the node nobody waits on, though neither has work queued; load weight 0
    # (prefix only) ignores it.
    assert rank([waited, NodeFigures(0, 0, FAST)], PROMPT, 1.0, tie=0).order[0] == 1
    assert score(waited, PROMPT, 0.0, FAST) == pytest.approx(-1.0)
