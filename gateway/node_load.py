"""A node's load as this gateway sees it: the work it has open there and how fast the node gets
through work, measured from the requests that finish.

Work is counted in *tokens*: a request's prompt tokens the node must compute (not predicted
cached) plus its ``max_tokens`` budget. Throughput is measured in the same unit (work finished
per second the node had work open), so the budget's overestimate of a short answer is measured
away too. The work still *waiting* is estimated as a fluid: while any is open, the node gets
through it at its measured rate, so a request opened a while ago counts only what is left of it,
and the expected queueing delay is ``waiting tokens / tokens per second``.
Measurements decay with a half-life of ``HALF_LIFE_S``; until the first ones, a prior of
``PRIOR_TOKENS_PER_S`` (worth ``PRIOR_S`` seconds of measurement) stands in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

HALF_LIFE_S = 30.0  # how fast old throughput measurements fade (seconds)
PRIOR_TOKENS_PER_S = 2000.0  # a node's throughput before anything finished there (tokens/s)
PRIOR_S = 1.0  # the prior's weight, in seconds of measurement


@dataclass
class NodeLoad:
    """Open work and measured throughput of one node (this gateway's requests only)."""

    inflight: int = 0  # requests open on the node
    outstanding_tokens: int = 0  # their work, in tokens (module docstring)
    _worked: float = 0.0  # of that work, the part the node got through by _since (estimated)
    _done_tokens: float = PRIOR_TOKENS_PER_S * PRIOR_S  # decayed work finished
    _busy_s: float = PRIOR_S  # decayed seconds with work open
    _since: float = field(default_factory=time.monotonic)  # when _advance last ran

    def tokens_per_s(self) -> float:
        """Measured throughput, tokens of work per second the node was busy."""
        return self._done_tokens / self._busy_s

    def waiting_tokens(self, now: float | None = None) -> float:
        """The open work not done yet at ``now``: the open work less what the node got through at
        its measured rate while it had work open (module docstring)."""
        now = time.monotonic() if now is None else now
        elapsed = max(0.0, now - self._since) if self.inflight else 0.0
        return max(0.0, self.outstanding_tokens - self._worked - elapsed * self.tokens_per_s())

    def queue_s(self, now: float | None = None) -> float:
        """Expected wait before new work starts: the waiting work over the measured throughput."""
        return self.waiting_tokens(now) / self.tokens_per_s()

    def opened(self, tokens: int, now: float | None = None) -> None:
        """A request with ``tokens`` of work was sent to the node."""
        self._advance(time.monotonic() if now is None else now)
        self.inflight += 1
        self.outstanding_tokens += tokens

    def closed(self, tokens: int, finished: bool, now: float | None = None) -> None:
        """A request opened with ``tokens`` ended: ``finished`` (its work counts towards the
        throughput) or failed / abandoned (its work is only no longer outstanding)."""
        self._advance(time.monotonic() if now is None else now)
        self.inflight -= 1
        self.outstanding_tokens -= tokens
        self._worked = max(0.0, self._worked - tokens)  # its work is done (or dropped) now
        if finished:
            self._done_tokens += tokens

    def _advance(self, now: float) -> None:
        """Decay the measurements to ``now`` and count the busy time since the last call."""
        dt = now - self._since
        if dt <= 0:
            return
        if self.inflight:
            self._worked = min(self.outstanding_tokens, self._worked + dt * self.tokens_per_s())
        decay = 0.5 ** (dt / HALF_LIFE_S)
        self._done_tokens *= decay
        self._busy_s = self._busy_s * decay + (dt if self.inflight else 0.0)
        self._since = now
