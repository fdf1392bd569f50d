"""How the kv-aware router ranks nodes for one request: a pure function of named figures.

Nothing here reads a clock, a socket or the router's state; ``rank`` is given, per candidate
node, what the router knows of it now, and returns the order to try the nodes in and why the
first one won.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeFigures:
    """One candidate node's figures for one request."""

    predicted_tokens: int  # leading prompt tokens the node's cache holds (capped as a hit is)
    inflight: int  # requests this gateway has open on the node


@dataclass(frozen=True)
class Ranking:
    order: list[int]  # indexes into the candidates, best first
    reason: str  # prefix (the first node holds the longest prefix) | load (no hit, or load won)


def rank(nodes: Sequence[NodeFigures], prompt_len: int, load_weight: float, tie: int) -> Ranking:
    """Rank ``nodes`` by ``hit fraction - load_weight * load share``, the load share being the
    node's requests in flight over all of them (+1, this request). Equal scores go to the lower
    share, then round-robin from candidate ``tie`` (a counter the caller advances).

    ``prompt_len``: the request's prompt, in tokens.
    """
    total_inflight = sum(n.inflight for n in nodes)

    def score(k: int) -> tuple[float, float, int]:
        share = nodes[k].inflight / (total_inflight + 1)
        hit = nodes[k].predicted_tokens / max(1, prompt_len)
        return (hit - load_weight * share, -share, -((k - tie) % len(nodes)))

    order = sorted(range(len(nodes)), key=score, reverse=True)
    best_hit = nodes[order[0]].predicted_tokens
    most = max(n.predicted_tokens for n in nodes)
    return Ranking(order, "prefix" if best_hit > 0 and best_hit >= most else "load")
