"""Structured outputs on the replica: a request's grammar, compiled once, enforced as a token mask.

xgrammar does the grammar work (docs/architecture.md, "Structured outputs and tools": why it and
not llguidance). `Grammars` (one per replica) holds the tokenizer's vocabulary as xgrammar sees
it and a compiler whose cache keeps compiled grammars by their text, so a schema that many
requests share (a tool set, an application's response format) compiles once. `Grammars.start`
compiles (it runs on the servicer's tokenize threads, off the event loop and the step loop) and
returns the request's `GrammarState`, a matcher positioned after any resumed output.

Each step `mask_logits` fills one bitmask row per constrained request (xgrammar's batched fill)
and sets the logits of every token the grammar does not allow next to -inf, in those rows only:
a batch without constrained requests pays one list scan, and the unconstrained rows of a mixed
batch are copied, never masked. End-of-sequence is among the allowed tokens only where the
grammar accepts the output so far. `accept` then moves each matcher past its sampled token.

Every constrained row's mask is also ANDed with the tokens that keep its bytes well-formed UTF-8
(computesvc.utf8_mask): xgrammar's character classes admit surrogates and overlong forms on
byte-level and byte-fallback vocabularies, and no grammar, mode or schema may emit them. A row
left without any token (a grammar that allows only ill-formed bytes there) fails its request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import torch

from kvtier.computesvc.utf8_mask import ACCEPT, Utf8Mask
from kvtier.structured_output import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint

log = logging.getLogger("kvtier.compute")

# Compiled grammars kept for reuse, in bytes of xgrammar's cache (it evicts the least recently used).
GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; clients need only the rest.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


class GrammarState:
    """One request's position in its grammar: the xgrammar matcher, where its bytes are in a
    UTF-8 character (`utf8`, a utf8_mask state), whether it has finished (accepted
    end-of-sequence; nothing is masked after that), and why no token was allowed (`stuck`)."""

    def __init__(self, matcher: Any, utf8: Utf8Mask):
        self.matcher = matcher
        self.utf8_mask = utf8
        self.utf8 = ACCEPT
        self.finished = False
        self.stuck: str | None = None

    def accept(self, token: int) -> bool:
        """Move past `token` (just sampled from the masked logits): False if the grammar refuses
        it or it breaks UTF-8, which the mask makes impossible unless the row's sampling failed."""
        if self.finished:
            return True
        utf8 = self.utf8_mask.next_state(self.utf8, token)
        if utf8 < 0:
            return False
        ok = bool(self.matcher.accept_token(token))
        if ok:
            self.utf8 = utf8
        self.finished = ok and self.matcher.is_terminated()
        return ok


class Grammars:
    """A replica's grammar compiler over its tokenizer (made on the first structured request).

    tokenizer: the model's Hugging Face tokenizer. vocab_size: columns of the model's logits
    (tokens past the tokenizer's are never allowed). eos_token_ids: the tokens that end a
    sequence, allowed where the grammar accepts."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: Any = None
        self._utf8: Utf8Mask | None = None
        self._lock = threading.Lock()  # one vocabulary scan even when two requests come at once

    def _compiler_of(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
                # The bytes xgrammar matches for each token (byte-level and byte-fallback decoded).
                specials = [*info.special_token_ids, *info.stop_token_ids]
                self._utf8 = Utf8Mask(info.decoded_vocab, specials, self.vocab_size)
            return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of `constraint` (from the cache when compiled before); ValueError
        naming its `param` and xgrammar's reason when it does not compile."""
        constraint.check()
        compiler = self._compiler_of()
        kind, value = constraint.kind, constraint.value
        try:
            if kind == JSON_SCHEMA:
                # Compact separators, no free whitespace: a weak model cannot wander off into
                # whitespace forever, and outputs are canonical (", " and ": ").
                schema = json.dumps(bounded_strings(json.loads(value)))
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if kind == JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == REGEX:
                return compiler.compile_regex(value)
            if kind == GRAMMAR:
                return compiler.compile_grammar(value)
            if kind == CHOICE:
                return compiler.compile_grammar(choice_grammar(value))
        except (RuntimeError, ValueError, TypeError) as e:
            why = _XGR_PREFIX.sub("", str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            raise ValueError(f"{constraint.param}: the {kind} does not compile: {why}") from None
        raise ValueError(f"{constraint.param}: unknown constraint kind {kind!r}")

    def start(self, constraint: Constraint, output_token_ids: list[int]) -> GrammarState:
        """A request's state: its grammar compiled, positioned after `output_token_ids` (tokens an
        earlier attempt delivered; ValueError if the grammar refuses them)."""
        import xgrammar

        grammar = self.compile(constraint)
        state = GrammarState(xgrammar.GrammarMatcher(grammar), self._utf8)
        for i, token in enumerate(output_token_ids):
            if not state.accept(token):
                raise ValueError(
                    f"{constraint.param}: resume_token_ids[{i}] = {token} does not match the {constraint.kind}"
                )
        return state


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """`logits` [num_seqs, vocab] with each constrained row's disallowed tokens at -inf: a new
    tensor when some row is constrained (the input stays the raw logits, for logprobs), the same
    tensor when none is. `states[i]`: row i's grammar (None = unconstrained). A row whose grammar
    allows no well-formed token gets its state's `stuck` set (`advance` fails it)."""
    rows = [i for i, s in enumerate(states) if s is not None and not s.finished]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], vocab)  # [num_seqs, ceil(vocab / 32)] int32
    matchers = [states[i].matcher for i in rows]
    if len(rows) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
    else:
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
    utf8 = states[rows[0]].utf8_mask
    for row in utf8.restrict(bitmask, rows, [states[i].utf8 for i in rows]):
        states[
            row
        ].stuck = "the request's grammar allows no token here that keeps the output well-formed UTF-8"
    out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
    if out.device.type != "cpu":
        bitmask = bitmask.to(out.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, indices=rows)
    return out


_BATCH: list[Any] = []


def _batch_matcher() -> Any:
    """xgrammar's batched bitmask filler (one thread: the replica's cores run the model)."""
    if not _BATCH:
        import xgrammar

        _BATCH.append(xgrammar.BatchGrammarMatcher(max_threads=1))
    return _BATCH[0]


# NOTE: xgrammar 0.2.9 lets a string with minLength/maxLength hold raw control characters
# (U+0000-U+001F), which strict JSON parsers refuse; its strings without bounds and its `pattern`
# strings do not. Such a string is compiled as the same length bounds over a pattern without them
# (and without `"` and `\`: no escapes inside a bounded string).
_SAFE_CHARS = r'[^"\\\x00-\x1f]'
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not subschemas


def bounded_strings(schema: Any) -> Any:
    """`schema` (parsed JSON Schema) with each length-bounded string, where no pattern, format,
    enum or const says more, turned into a pattern of safe characters with those bounds."""
    if isinstance(schema, list):
        return [bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_SCHEMAS else bounded_strings(v)) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (
        out.get("type") == "string"
        and bounded
        and not any(k in out for k in ("pattern", "format", *_NOT_SCHEMAS))
    ):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_SAFE_CHARS}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`: each a JSON string literal, which
    xgrammar's EBNF reads, with non-ASCII characters as themselves (an escaped character past
    U+FFFF would be two \\u surrogate escapes, which xgrammar encodes as two surrogates)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def advance(states: list[GrammarState | None], tokens: list[int], failed: dict[int, str]) -> dict[int, str]:
    """Move each constrained request past its sampled token; {row: why} for the rows whose token
    the grammar refused (added to `failed`, whose rows are skipped)."""
    for i, (state, token) in enumerate(zip(states, tokens, strict=True)):
        if state is not None and state.stuck:
            failed[i] = state.stuck
        elif state is not None and i not in failed and not state.accept(token):
            failed[i] = f"the sampled token {token} does not match the request's grammar"
    return failed
