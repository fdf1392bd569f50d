"""The media a KV block can live on: one table, read by the cache service, the router and the wire.

A row is a medium: its ``name`` (what a tier, a KV event, GetStats and LookupPrefix call it),
its ``rank`` (0 is the device pool; an evicted block falls through the lower media in rank
order and a lookup asks them in the same order), its ``price`` (what a hit token served from it
costs, as a fraction of recomputing that token: the router's figure, ``gateway/scoring.py``) and
``kv_event_medium`` (the medium vLLM's KV events name: ``CPU``, ``STORAGE``; None for the device,
whose name is the publisher's: ``GPU``, or ``CPU`` for a CPU pool).

A new tier adds one row here and one module in ``cachesvc/`` implementing
``kvtier.cachesvc.tiers.Tier`` (docs/architecture.md, "Tiers"). Prices are issue 22's targets
for a promotion (host <= 0.2x, disk <= 0.3x of recompute; bench/tiers_e2e.py measured 0.07x and
0.08x for a 2,000-token prefix), so a node holding a prefix higher up beats one holding it
lower, and any hit beats a miss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Medium:
    """One place blocks live (module docstring)."""

    name: str
    rank: int  # 0 = the device; lower media are asked and filled in rank order
    price: float  # a hit token's cost as a fraction of recomputing it (0 = free, 1 = a miss)
    kv_event_medium: str | None  # vLLM's KV-event medium; None: the publisher's device medium
    across_nodes: bool = False  # one store every node reads (the router prices a hit on any node)

    @property
    def token_value(self) -> float:
        """The prefill a hit token here saves, as a fraction of a device token's."""
        return 1.0 - self.price


MEDIA: tuple[Medium, ...] = (
    Medium("device", 0, 0.0, None),
    Medium("host", 1, 0.2, "CPU"),
    Medium("disk", 2, 0.3, "STORAGE"),  # vLLM's MEDIUM_STORAGE (vllm/distributed/kv_events.py)
    # Mooncake Store across nodes (cachesvc.shared_tier): a network fetch, priced from
    # bench/shared_tier.py's store-vs-recompute TTFT (0.31x on the 2-core VM); below the node's own media.
    Medium("shared", 3, 0.35, "SHARED", across_nodes=True),
)
"""Every medium, by rank. A row's position is its rank (``kvtier.cachesvc.events`` numbers event
kinds by it)."""

DEVICE = MEDIA[0]
LOWER_MEDIA: tuple[Medium, ...] = MEDIA[1:]
"""The media below the device, in the order an evicted block falls through them."""

_BY_NAME = {m.name: m for m in MEDIA}
assert [m.rank for m in MEDIA] == list(range(len(MEDIA))), "a row's position is its rank"


def medium(name: str) -> Medium:
    """The row named ``name``; ValueError naming the known media otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown medium {name!r}: one of {[m.name for m in MEDIA]}") from None


def names() -> tuple[str, ...]:
    """Every medium's name, by rank."""
    return tuple(m.name for m in MEDIA)
