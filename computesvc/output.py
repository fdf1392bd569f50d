"""Output processing: turn each new token into the text to stream, and decide when to stop.

Detokenization is incremental. Each token decodes only a window of the most recent output
tokens, never the whole output: the text a token adds depends on the few tokens before it (a
leading space, the bytes of a multi-byte character), not on the rest. The window starts
`CONTEXT_TOKENS` back and slides forward once it holds `WINDOW_TOKENS`, so decode work per token
is bounded whatever the output's length.

Text ending in U+FFFD is held back: that is how an incomplete UTF-8 character decodes until its
last byte arrives (byte-level tokenizers split characters across tokens). Stop strings are
looked for only in the new text and the few characters streamed just before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from computesvc.request import Request

REPLACEMENT = "\ufffd"

# Window sizes, in output tokens. NOTE: a token decodes at most WINDOW_TOKENS ids, plus
# CONTEXT_TOKENS once every WINDOW_TOKENS - CONTEXT_TOKENS tokens when the window slides. The
# context must hold more tokens than an incomplete UTF-8 character can span (3 bytes, so 3
# tokens unless special tokens, which decode to nothing, come between its bytes): the window
# then never starts inside a held character, and decoding it from its start gives the same
# characters as decoding the whole output, past the few that a cut through a character garbles
# (those were streamed already).
CONTEXT_TOKENS = 6
WINDOW_TOKENS = 24


@dataclass(slots=True)
class TextState:
    """How far one request's output tokens are detokenized."""

    window_start: int = 0  # index in the output tokens where the decode window starts
    sent: int = 0  # characters of the window's text already streamed
    tail: str = ""  # the last streamed characters: a stop string may begin in them


def _stable_length(text: str) -> int:
    """Characters of `text` that can be streamed: all but an incomplete character at its end
    (which decodes to one U+FFFD until its last byte arrives)."""
    return len(text) - 1 if text.endswith(REPLACEMENT) else len(text)


class OutputProcessor:
    """Streams the text of each sampled token and finishes a request on a stop condition."""

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def process(self, req: Request, token: int, max_model_len: int) -> tuple[str, str]:
        """`token`, the newest of `req.output_token_ids`, was sampled: (finish reason or "", new
        text to stream). Past a stop string the text is cut; a finished request flushes held text."""
        state, p = req.text_state, req.params
        output = req.output_token_ids
        window = self._decode(output[state.window_start :])
        new = window[state.sent : _stable_length(window)]
        reason = ""
        for stop in p.stop:
            before = state.tail[1 - len(stop) :] if len(stop) > 1 else ""
            at = (before + new).find(stop)
            if at >= 0:
                # Streamed text cannot be taken back: a stop string that began in it cuts only
                # the new text (all of it).
                return "stop", new[: max(0, at - len(before))]
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(output) >= p.max_tokens or req.num_tokens >= max_model_len:
            reason = "length"
        if reason:
            return reason, window[state.sent :]
        self._advance(req, new)
        return "", new

    def _advance(self, req: Request, new: str) -> None:
        """Record that `new` was streamed for the newest output token."""
        state, output = req.text_state, req.output_token_ids
        state.sent += len(new)
        if req.params.stop:
            keep = max(map(len, req.params.stop)) - 1
            state.tail = (state.tail + new)[-keep:] if keep else ""
        if len(output) - state.window_start >= WINDOW_TOKENS:
            state.window_start = len(output) - CONTEXT_TOKENS
            state.sent = _stable_length(self._decode(output[state.window_start :]))

    def resume(self, req: Request) -> None:
        """Bring `req.text_state` to where streaming its output tokens (delivered by an earlier
        attempt of the request, on another replica) left it, streaming nothing: the next token's
        text then continues exactly where the delivered text ended."""
        delivered, req.output_token_ids = req.output_token_ids, []
        req.text_state = TextState()
        for token in delivered:
            req.output_token_ids.append(token)
            state = req.text_state
            window = self._decode(req.output_token_ids[state.window_start :])
            self._advance(req, window[state.sent : _stable_length(window)])
