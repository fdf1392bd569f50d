"""Output processing: turn each new token into the text to stream, and decide when to stop.

Detokenization is incremental. Each token decodes only a window of the most recent output
tokens, never the whole output: the text a token adds depends on the few tokens before it (a
leading space, the bytes of a multi-byte character), not on the rest. The window starts
`CONTEXT_TOKENS` back and slides forward once it holds `WINDOW_TOKENS`, so decode work per token
is bounded whatever the output's length.

Text ending in U+FFFD is held back: that is how an incomplete UTF-8 character decodes until its
last byte arrives (byte-level tokenizers split characters across tokens). Text that could still
become a stop string is held back too (vLLM does the same): the longest end of the text that
begins one of the request's stop strings waits until the next tokens show it does not (it is
then streamed) or complete the stop string (the request then stops, and the text ends before it,
or after it with `include_stop_str_in_output`). Streamed text can never be taken back, so a stop
string therefore never begins in what was streamed, and the text a client sees, streamed or not,
never holds any part of a matched stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.computesvc.request import Request

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
    sent: int = 0  # characters of the window's text already decoded to stable text
    held: str = ""  # stable text not streamed yet: it may be the start of a stop string


def _held_length(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that are the start of a stop string (the longest such end,
    shorter than the stop string itself; 0 when none)."""
    best = 0
    last = text[-1:]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if stop[k - 1] == last and text.endswith(stop[:k]):
                best = k
                break
    return best


def _first_stop(text: str, stops: list[str]) -> tuple[int, str]:
    """(where the earliest stop string in `text` begins, that stop string); (-1, "") when none."""
    found = (-1, "")
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (found[0] < 0 or at < found[0]):
            found = (at, stop)
    return found


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
        text to stream). A stop string ends the text (before it; after it with
        include_stop_str_in_output); a request finished otherwise flushes all held text."""
        state, p = req.text_state, req.params
        output = req.output_token_ids
        window = self._decode(output[state.window_start :])
        new = window[state.sent : _stable_length(window)]
        if p.stop:
            text = state.held + new
            at, stop = _first_stop(text, p.stop)
            if at >= 0:
                return "stop", text[: at + len(stop) if p.include_stop_str_in_output else at]
        reason = ""
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(output) >= p.max_tokens or req.num_tokens >= max_model_len:
            reason = "length"
        if reason:
            return reason, state.held + window[state.sent :]
        return "", self._advance(req, new)

    def _advance(self, req: Request, new: str) -> str:
        """Record `new`, the newest output token's stable text; what may be streamed of it and of
        the text held before it (all but the end that may begin a stop string)."""
        state, output, stops = req.text_state, req.output_token_ids, req.params.stop
        state.sent += len(new)
        out = new
        if stops:
            text = state.held + new
            cut = len(text) - _held_length(text, stops)
            out, state.held = text[:cut], text[cut:]
        if len(output) - state.window_start >= WINDOW_TOKENS:
            state.window_start = len(output) - CONTEXT_TOKENS
            state.sent = _stable_length(self._decode(output[state.window_start :]))
        return out

    def resume(self, req: Request) -> None:
        """Bring `req.text_state` to where streaming its output tokens (delivered by an earlier
        attempt of the request, on another replica) left it, streaming nothing: the next token's
        text then continues exactly where the delivered text ended (text the earlier attempt held
        back, as the start of a stop string, is held here too, and streamed when it resolves)."""
        delivered, req.output_token_ids = req.output_token_ids, []
        req.text_state = TextState()
        for token in delivered:
            req.output_token_ids.append(token)
            state = req.text_state
            window = self._decode(req.output_token_ids[state.window_start :])
            self._advance(req, window[state.sent : _stable_length(window)])
