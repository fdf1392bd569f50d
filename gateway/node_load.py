"""A node's load as this gateway sees it: the prefill work it has waiting there and how fast the
node gets through it, measured from the requests it serves.

Work is counted in *tokens*: a request's prompt tokens the node must compute (not predicted
cached). It waits from routing until the request's first token (``started``): what delays a new
request's first token is the prefill ahead of it, not the answers being decoded (a replica
prefills every waiting request in its next step, between decode steps). Throughput is measured
in the same unit: work started per second the node had work waiting (decode steps interleaved
with those prefills slow it, and are measured with it). The work still *waiting* is estimated
as a fluid: while any waits, the node gets through it at its measured rate, so a request routed a
while ago counts only what is left of it, and the expected queueing delay is
``waiting tokens / tokens per second``. ``waiting_requests`` (routed, no first token yet) is what
a new prefill would share a step with. A request that never reports its first token (``started``
not called) waits until ``closed``.
Measurements decay with a half-life of ``HALF_LIFE_S``; until the first ones, a prior of
``PRIOR_TOKENS_PER_S`` (worth ``PRIOR_S`` seconds of measurement) stands in: a CPU's prefill rate,
so a new gateway does not take a busy node for idle (an optimistic prior drains its queue
estimate before the node has got through it: bench/README.md, router, third session).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

HALF_LIFE_S = 30.0  # how fast old throughput measurements fade (seconds)
PRIOR_TOKENS_PER_S = 500.0  # a node's throughput before anything started there (tokens/s)
PRIOR_S = 1.0  # the prior's weight, in seconds of measurement


@dataclass
class NodeLoad:
    """Open work and measured throughput of one node (this gateway's requests only)."""

    inflight: int = 0  # requests open on the node
    waiting_requests: int = 0  # of them, those without their first token yet
    outstanding_tokens: int = 0  # their work, in tokens (module docstring)
    _worked: float = 0.0  # of that work, the part the node got through by _since (estimated)
    _done_tokens: float = PRIOR_TOKENS_PER_S * PRIOR_S  # decayed work done (started)
    _busy_s: float = PRIOR_S  # decayed seconds with work waiting
    _since: float = field(default_factory=time.monotonic)  # when _advance last ran

    def tokens_per_s(self) -> float:
        """Measured throughput, tokens of work per second the node had work waiting."""
        return self._done_tokens / self._busy_s

    def waiting_tokens(self, now: float | None = None) -> float:
        """The open work not done yet at ``now``: the open work less what the node got through at
        its measured rate while it had work open (module docstring)."""
        now = time.monotonic() if now is None else now
        elapsed = max(0.0, now - self._since) if self.waiting_requests else 0.0
        return max(0.0, self.outstanding_tokens - self._worked - elapsed * self.tokens_per_s())

    def queue_s(self, now: float | None = None) -> float:
        """Expected wait before new work starts: the waiting work over the measured throughput."""
        return self.waiting_tokens(now) / self.tokens_per_s()

    def opened(self, tokens: int, now: float | None = None) -> None:
        """A request with ``tokens`` of work was sent to the node."""
        self._advance(time.monotonic() if now is None else now)
        self.inflight += 1
        self.waiting_requests += 1
        self.outstanding_tokens += tokens

    def started(self, tokens: int, now: float | None = None) -> None:
        """A request opened with ``tokens`` got its first token: its work is done and counts
        towards the throughput. Call at most once per request, before ``closed``."""
        self._advance(time.monotonic() if now is None else now)
        self.waiting_requests -= 1
        self._leave(tokens)
        self._done_tokens += tokens

    def closed(self, tokens: int, finished: bool, started: bool = False, now: float | None = None) -> None:
        """A request opened with ``tokens`` ended: ``finished`` (its work counts towards the
        throughput, unless ``started`` counted it already) or failed / abandoned (its work is
        only no longer outstanding)."""
        self._advance(time.monotonic() if now is None else now)
        self.inflight -= 1
        if started:
            return
        self.waiting_requests -= 1
        self._leave(tokens)
        if finished:
            self._done_tokens += tokens

    def _leave(self, tokens: int) -> None:
        """A request's work is done (or dropped): it no longer waits."""
        self.outstanding_tokens -= tokens
        self._worked = max(0.0, self._worked - tokens)

    def _advance(self, now: float) -> None:
        """Decay the measurements to ``now`` and count the busy time since the last call."""
        dt = now - self._since
        if dt <= 0:
            return
        if self.waiting_requests:
            self._worked = min(self.outstanding_tokens, self._worked + dt * self.tokens_per_s())
        decay = 0.5 ** (dt / HALF_LIFE_S)
        self._done_tokens *= decay
        self._busy_s = self._busy_s * decay + (dt if self.waiting_requests else 0.0)
        self._since = now
