"""Which running sequence to preempt, and how: the cost model (pure; no I/O, no clock).

The scheduler (computesvc.scheduler) asks `choose_victim` when the cache refuses room. Each
candidate's cost, in seconds of this replica's time, is

    cost = (min(recompute_s, swap_s) + progress_s) * fairness

- recompute_s: one cache call (its Free; the Allocate that brings it back is batched with
  admission's) and its computed tokens through prefill again (tokens / measured prefill
  tokens/s); its committed blocks may stay cached, so this is an upper bound;
- swap_s: two cache calls of its own (SwapOut now, SwapIn later) and its device blocks over the
  link both ways (bytes / measured swap bytes/s, each way); not an option when the host tier
  lacks room (the last SwapOut was refused) or when the refusal was its own tenant's limit (a
  quota counts the host tier's blocks too: only freeing them helps). The fixed call costs make
  a short sequence cheaper to recompute, the per-token prefill cost a long one cheaper to swap;
- progress_s: the decode time it has had, weighted by how far it has come
  (generated / (generated + remaining)): a sequence near its end would soon give its blocks
  back anyway, and stopping it wastes the most;
- fairness: 1 for a tenant at or under its share of this replica's device blocks, share / held
  for one over it (an over-share tenant's sequences are cheaper to preempt).

The victim is the candidate of least cost, in the mode (swap or recompute) cheaper for it.
Two guards keep it from thrashing: a sequence swapped in fewer than `min_resident_steps` steps
ago, and one preempted `max_preemptions` times already, are passed over; when every candidate
is guarded the scheduler waits for the others if any can still run (None), else the guards
give way (reason "forced", and the victim is freed, never swapped: a swap would come straight
back). When a tenant's own limit refused the room (`refused_tenant`), that tenant's sequences
are the candidates: one tenant's quota never preempts another tenant.

The scheduler adds two rules of its own over the `Ledger` (computesvc/preemptor.py): swapped
sequences come back only once the pool has refused no room for `min_resident_steps` steps
(`Ledger.settled`), and a victim freed to recompute holds its tenant's admissions back for
`backoff_s` (doubling with its preemptions) or until one of the tenant's sequences finishes.

`policy="newest"` is the scheduler's old rule: the newest candidate, swapped out, with no
guards; `policy="newest-recompute"` is vLLM's (v1): the newest, always freed to recompute. Both
are there for comparison (bench/preemption.py).

Each decision says why a victim freed to recompute was not swapped (`Decision.because`, a key
of RECOMPUTE_BECAUSE): the replica's INFO line prints it and metrics count by it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("cost", "newest", "newest-recompute")
SWAP, RECOMPUTE = "swap", "recompute"
# Reasons a preemption happens (metrics label): the pool had no room for the step; a tenant's
# own quota or share refused it; every candidate was guarded and none could run.
POOL, TENANT, FORCED = "pool", "tenant", "forced"
REASONS = (POOL, TENANT, FORCED)
# Why a victim was freed to recompute rather than swapped out: key (metrics label, `because`) ->
# the words of the replica's INFO line. Only "cheaper" is the cost model's choice; the others
# say what ruled the swap out.
RECOMPUTE_BECAUSE = {
    "cheaper": "cheaper than a swap",
    "tenant": "swap not allowed: tenant quota",  # a quota counts the host tier's blocks too
    "forced": "swap not allowed: forced",  # a guarded victim swapped out would come straight back
    "host_full": "swap not allowed: host tier full",  # the last SwapOut was refused
    "host_refused": "the host tier refused the swap",  # a swap was chosen; its SwapOut was refused
    "policy": "the policy never swaps",  # newest-recompute (vLLM's rule)
}

# Priors until the replica has measured its own figures (a CPU prefill of a small model; a
# host-memory copy with an RPC around it), and how fast measurements replace them.
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
PRIOR_SWAP_BYTES_PER_S = 1e9
PRIOR_DECODE_STEP_S = 0.02
PRIOR_CALL_S = 0.001
SMOOTHING = 0.2  # weight of each new measurement in the running average
# How long a tenant whose own limit preempted one of its sequences is not admitted (unless one of
# its sequences finishes first): doubling with the victim's preemptions, capped.
BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


def backoff_s(times: int, first_s: float = BACKOFF_S, cap_s: float = MAX_BACKOFF_S) -> float:
    """Seconds a tenant waits for admission after its own limit preempted a sequence (or, with
    admission's figures, refused its Allocate) for the `times`-th time in a row (1, 2, ...):
    `first_s`, doubling, at most `cap_s` (0.05 s, 0.1 s, 0.2 s, ... up to 2 s by default)."""
    return min(cap_s, first_s * 2 ** max(0, times - 1))


@dataclass
class Rates:
    """What this replica measured of its own speed, as running averages (priors until then)."""

    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    swap_bytes_per_s: float = PRIOR_SWAP_BYTES_PER_S
    decode_step_s: float = PRIOR_DECODE_STEP_S
    call_s: float = PRIOR_CALL_S  # one cache call's round trip (calls that move no KV)

    @staticmethod
    def _mix(old: float, new: float) -> float:
        return old + SMOOTHING * (new - old)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill forward of `tokens` tokens took `seconds`."""
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, tokens / seconds)

    def observe_call(self, seconds: float) -> None:
        """A cache call that moved no KV (Extend, Free, ...) took `seconds`, end to end."""
        if seconds > 0:
            self.call_s = self._mix(self.call_s, seconds)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        """A SwapOut or SwapIn moved `num_bytes` in `seconds` (the call, end to end: its round
        trip is taken off, at most 90% of it)."""
        if num_bytes > 0 and seconds > 0:
            moving = max(seconds - self.call_s, 0.1 * seconds)
            self.swap_bytes_per_s = self._mix(self.swap_bytes_per_s, num_bytes / moving)

    def observe_decode(self, seconds: float) -> None:
        """A batched decode forward took `seconds`."""
        if seconds > 0:
            self.decode_step_s = self._mix(self.decode_step_s, seconds)


class Ledger:
    """What a replica remembers for the cost model: its measured `rates`, the step count, how
    often each sequence was preempted and when it was last swapped in, and whether the host
    tier has room. Keys are the scheduler's requests (held weakly: a finished one drops out)."""

    def __init__(self) -> None:
        self.rates = Rates()
        self.step = 0
        self.host_has_room = True  # until a SwapOut is refused; a SwapIn frees host slots again
        # The step the pool last refused room for running sequences (a tenant's own limit aside).
        self.refused_at = -(1 << 30)
        self._preemptions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._resumed_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def settled(self, steps: int) -> bool:
        """Whether the cache has refused no room for `steps` steps: sequences may come back."""
        return self.step - self.refused_at >= steps

    def preemptions(self, key) -> int:
        return self._preemptions.get(key, 0)

    def resident_steps(self, key) -> int:
        """Steps since `key` was swapped back in (large when it never was)."""
        at = self._resumed_at.get(key)
        return 1 << 30 if at is None else self.step - at

    def preempted(self, key) -> None:
        self._preemptions[key] = self.preemptions(key) + 1

    def swapped_in(self, key) -> None:
        self._resumed_at[key] = self.step
        self.host_has_room = True


@dataclass(frozen=True)
class Candidate:
    """A running sequence that could be preempted. `key` is the scheduler's own handle."""

    key: object
    arrival: float  # time.monotonic() seconds: the newest has the largest
    tenant: str
    computed_tokens: int  # tokens whose KV is in the pool (what recompute runs again)
    num_blocks: int  # device blocks it holds (what a swap moves, each way)
    generated_tokens: int
    remaining_tokens: int  # most tokens it may still generate
    preemptions: int = 0  # times preempted already
    resident_steps: int = 1 << 30  # steps since it was swapped back in (large: never swapped)


@dataclass(frozen=True)
class Pressure:
    """The situation a victim is chosen in."""

    block_bytes: int  # bytes one block holds (all layers, K and V)
    host_has_room: bool = True  # False after a SwapOut was refused, until a SwapIn frees slots
    refused_tenant: str | None = None  # a tenant's own limit refused it (None: the pool, or unknown)
    can_wait: bool = False  # some running sequence can still make progress without the room
    min_resident_steps: int = 4
    max_preemptions: int = 3


@dataclass(frozen=True)
class Decision:
    """The victim, how it is preempted, and why (the `preempt` span's attributes)."""

    victim: Candidate
    mode: str  # SWAP or RECOMPUTE
    reason: str  # POOL, TENANT or FORCED
    policy: str
    cost_s: float = 0.0
    recompute_s: float = 0.0
    swap_s: float = 0.0
    progress_s: float = 0.0
    fairness: float = 1.0
    candidates: int = 0  # how many were weighed (after the guards)
    guarded: int = 0  # how many the guards passed over
    because: str = ""  # mode RECOMPUTE: why not a swap (a key of RECOMPUTE_BECAUSE)

    def attributes(self) -> dict[str, object]:
        return {
            "kvtier.preemption.policy": self.policy,
            "kvtier.preemption.mode": self.mode,
            "kvtier.preemption.reason": self.reason,
            "kvtier.preemption.because": self.because,
            "kvtier.preemption.tenant": self.victim.tenant,
            "kvtier.preemption.cost_s": self.cost_s,
            "kvtier.preemption.recompute_s": self.recompute_s,
            "kvtier.preemption.swap_s": self.swap_s,
            "kvtier.preemption.progress_s": self.progress_s,
            "kvtier.preemption.fairness": self.fairness,
            "kvtier.preemption.candidates": self.candidates,
            "kvtier.preemption.guarded": self.guarded,
            "kvtier.preemption.computed_tokens": self.victim.computed_tokens,
            "kvtier.preemption.blocks": self.victim.num_blocks,
            "kvtier.preemption.preemptions": self.victim.preemptions,
        }

    def describe(self) -> str:
        """The attributes as one log line: `mode=swap reason=pool cost_s=0.0021 ...`."""
        return " ".join(
            f"{key.rsplit('.', 1)[1]}={value:.3g}"
            if isinstance(value, float)
            else f"{key.rsplit('.', 1)[1]}={value}"
            for key, value in self.attributes().items()
        )


def fairness(candidates: Sequence[Candidate]) -> dict[str, float]:
    """Tenant -> cost weight: share / held for a tenant holding more than an even share of the
    candidates' device blocks, else 1."""
    held: dict[str, int] = {}
    for c in candidates:
        held[c.tenant] = held.get(c.tenant, 0) + c.num_blocks
    share = sum(held.values()) / max(1, len(held))
    return {t: (share / n if n > share else 1.0) for t, n in held.items()}


def _priced(c: Candidate, rates: Rates, no_swap: str, block_bytes: int, weight: float) -> Decision:
    """`c`'s cost, in the cheaper mode it may be preempted in; `no_swap`: why a swap is ruled out
    (a RECOMPUTE_BECAUSE key), "" when it is allowed (reason and counts left for the caller)."""
    recompute_s = rates.call_s + c.computed_tokens / rates.prefill_tokens_per_s
    swap_s = 2 * (rates.call_s + c.num_blocks * block_bytes / rates.swap_bytes_per_s)
    done = c.generated_tokens / max(1, c.generated_tokens + c.remaining_tokens)
    progress_s = rates.decode_step_s * c.generated_tokens * done
    mode = SWAP if not no_swap and swap_s < recompute_s else RECOMPUTE
    move_s = swap_s if mode == SWAP else recompute_s
    cost_s = (move_s + progress_s) * weight
    because = "" if mode == SWAP else no_swap or "cheaper"
    return Decision(c, mode, POOL, "cost", cost_s, recompute_s, swap_s, progress_s, weight, because=because)


def choose_victim(
    candidates: Sequence[Candidate], rates: Rates, pressure: Pressure, policy: str = "cost"
) -> Decision | None:
    """The sequence to preempt among `candidates` (the running ones), or None to wait (none,
    or every one is guarded while another can still run). See the module docstring."""
    if not candidates:
        return None
    if policy in ("newest", "newest-recompute"):
        newest = max(candidates, key=lambda c: c.arrival)
        if policy == "newest-recompute":
            mode, because = RECOMPUTE, "policy"
        else:
            mode, because = (SWAP, "") if pressure.host_has_room else (RECOMPUTE, "host_full")
        return Decision(newest, mode, POOL, policy, candidates=len(candidates), because=because)
    if policy != "cost":
        raise ValueError(f"preemption policy {policy!r} is not one of {POLICIES}")
    reason = POOL
    pool = list(candidates)
    if pressure.refused_tenant is not None:
        own = [c for c in pool if c.tenant == pressure.refused_tenant]
        if own:
            pool, reason = own, TENANT
    free = [
        c
        for c in pool
        if c.resident_steps >= pressure.min_resident_steps and c.preemptions < pressure.max_preemptions
    ]
    guarded = len(pool) - len(free)
    no_swap = "tenant" if reason == TENANT else "" if pressure.host_has_room else "host_full"
    if not free:
        if pressure.can_wait:
            return None
        free, reason, no_swap = pool, FORCED, "forced"
    weights = fairness(candidates)
    priced = [_priced(c, rates, no_swap, pressure.block_bytes, weights[c.tenant]) for c in free]
    best = min(priced, key=lambda d: (d.cost_s, -d.victim.arrival))
    return dataclasses.replace(best, reason=reason, candidates=len(free), guarded=guarded)
