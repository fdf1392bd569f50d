"""How the kv-aware router ranks nodes for one request: a pure function of named figures.

Nothing here reads a clock, a socket or the router's state; ``rank`` is given, per candidate
node, what the router knows of it now, and returns the order to try the nodes in and why the
first one won.

The score of a node is the time to first token the request would cost there, negated: its own,
and what it adds to the requests waiting there for theirs:

    score = saved_s - queue_s - prompt_s - shared_s
    saved_s = saved tokens / prefill_tokens_per_s   (prefill the node's cache saves)
    saved tokens = device tokens + sum over the media below of (1 - price) * their tokens
    queue_s = load_weight * outstanding tokens / the node's tokens_per_s   (work queued ahead)
    prompt_s = prompt tokens / prefill_tokens_per_s             (the whole prefill)
    shared_s = load_weight * waiting requests * (prompt_s - saved_s)

``shared_s``: a replica prefills every request waiting for its first token in one step, so the
request's own prefill delays each request already waiting on the node (bench/router.py's dump:
a cached request routed just before two misses reached its first token with them, 1.3 s later).
A miss therefore goes where fewer requests wait; a hit, whose prefill is short, barely pays it.

The prefill terms use one rate for every node (the candidates' mean throughput): a throughput
measured from a few requests is noisy (a replica's first request is slow), and a noisy rate
must not outweigh a cached prefix on an idle node. A node's own rate prices only its queue.

A hit below the device is worth less than a device hit: the cache promotes it (copies it into the
pool) before compute reads it, and that copy costs a fraction of recomputing the block: the
medium's ``price`` in ``kvtier.media`` (host 0.2, disk 0.3: issue 22's targets for a promotion;
bench/tiers_e2e.py measured 0.07x and 0.08x for a 2,000-token prefix), so a node holding a
prefix on the device beats one holding it below, and both beat a miss.

So a node holding the prompt's prefix wins until the work queued on it costs more than the
prefill it saves: then the request *spills* to the best other node, which caches the prefix too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.media import medium

REASONS = ("prefix", "load_spill", "tie")
TIE_FRACTION = 0.1  # scores within this fraction of the best one count as equal


@dataclass(frozen=True)
class NodeFigures:
    """One candidate node's figures for one request."""

    predicted_tokens: int  # leading prompt tokens the node's pool holds (capped as a hit is)
    outstanding_tokens: int = 0  # prefill waiting on the node (uncached prompt tokens; node_load.py)
    tokens_per_s: float = 1.0  # the node's measured throughput of that work (> 0)
    inflight: int = 0  # requests this gateway has open on the node
    # Prompt tokens after the pool's held below it: medium name (kvtier.media) -> tokens.
    below_tokens: Mapping[str, int] = field(default_factory=dict)
    waiting_requests: int = 0  # requests on the node still waiting for their first token

    @property
    def saved_tokens(self) -> float:
        """The prefill the hit saves, in device tokens (module docstring)."""
        return self.predicted_tokens + sum(
            medium(name).token_value * n for name, n in self.below_tokens.items()
        )


@dataclass(frozen=True)
class Ranking:
    order: list[int]  # indexes into the candidates, best first
    scores: list[float]  # per candidate (not reordered): minus the time to first tokens it costs, s
    reason: str  # one of REASONS (see rank)


def score(node: NodeFigures, prompt_len: int, load_weight: float, prefill_tokens_per_s: float) -> float:
    """Minus the expected seconds to first tokens the request costs on ``node``: its own and the
    waiting requests' (module docstring)."""
    queue_s = load_weight * node.outstanding_tokens / node.tokens_per_s
    prefill_s = (prompt_len - node.saved_tokens) / prefill_tokens_per_s
    return -(queue_s + prefill_s * (1 + load_weight * node.waiting_requests))


def rank(nodes: Sequence[NodeFigures], prompt_len: int, load_weight: float, tie: int) -> Ranking:
    """Rank ``nodes`` by ``score``, best first; scores within TIE_FRACTION of the best are equal
    and go to the node whose cache saves the most prefill, then to fewer requests in flight, then
    round-robin from candidate ``tie`` (a counter the caller advances).

    ``prompt_len``: the request's prompt, in tokens. ``load_weight``: the weight of the queueing
    delay against the prefill saved (1 = both in seconds; 0 = prefix only). The reason is
    ``prefix`` when the first node's hit saves the most (``saved_tokens``), ``load_spill`` when a
    node saving more lost on load, ``tie`` when no node holds any of the prompt.
    """
    prefill_tokens_per_s = sum(n.tokens_per_s for n in nodes) / len(nodes)
    scores = [score(n, prompt_len, load_weight, prefill_tokens_per_s) for n in nodes]
    by_score = sorted(range(len(nodes)), key=lambda k: scores[k], reverse=True)
    best = scores[by_score[0]]
    # Measured throughputs differ by noise: scores this close to the best are equal, so requests
    # that no node holds spread over the nodes instead of all going to the one measured fastest.
    # Among equals the largest hit wins: as fast to a first token, it adds the least work to its
    # node (a spill prefills the whole prompt again, and evicts blocks to hold it).
    equal = [k for k in by_score if scores[k] >= best - TIE_FRACTION * abs(best)]
    equal.sort(
        key=lambda k: (nodes[k].saved_tokens, -nodes[k].inflight, -((k - tie) % len(nodes))), reverse=True
    )
    order = equal + [k for k in by_score if k not in equal]
    most = max(n.saved_tokens for n in nodes)
    if most == 0:
        reason = "tie"
    elif nodes[order[0]].saved_tokens == most:
        reason = "prefix"
    else:
        reason = "load_spill"
    return Ranking(order, scores, reason)
