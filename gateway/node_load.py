"""A node's load as this gateway sees it: the work it has open there and how fast the node gets
through work, measured from the requests that finish.

Work is counted in *tokens*: a request's prompt tokens the node must compute (not predicted
cached) plus its ``max_tokens`` budget. Throughput is measured in the same unit (work finished
per second the node had work open), so the budget's overestimate of a short answer is measured
away too, and the expected queueing delay is ``outstanding tokens / tokens per second``.
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
    _done_tokens: float = PRIOR_TOKENS_PER_S * PRIOR_S  # decayed work finished
    _busy_s: float = PRIOR_S  # decayed seconds with work open
    _since: float = field(default_factory=time.monotonic)  # when _advance last ran

    def tokens_per_s(self) -> float:
        """Measured throughput, tokens of work per second the node was busy."""
        return self._done_tokens / self._busy_s

    def queue_s(self) -> float:
        """Expected wait before new work starts: the open work over the measured throughput."""
        return self.outstanding_tokens / self.tokens_per_s()

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
        if finished:
            self._done_tokens += tokens

    def _advance(self, now: float) -> None:
        """Decay the measurements to ``now`` and count the busy time since the last call."""
        dt = now - self._since
        if dt <= 0:
            return
        decay = 0.5 ** (dt / HALF_LIFE_S)
        self._done_tokens *= decay
        self._busy_s = self._busy_s * decay + (dt if self.inflight else 0.0)
        self._since = now
