"""The UTF-8 automaton and token mask (computesvc.utf8_mask) and the grammar mask it narrows.

The automaton is checked against Python's strict UTF-8 decoder on any bytes (hypothesis), the
mask against the automaton on vocabularies of multi-byte tokens, and both under xgrammar on a
byte-level vocabulary (the built-in byte tokenizer) and a byte-fallback one (SentencePiece-style
<0xXX> tokens beside whole-character tokens): random logits, steered to the lead bytes whose
next byte has invalid choices, decode as strict UTF-8 in every mode, with lengths in characters.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.computesvc.structured_output import Grammars, advance, mask_logits
from kvtier.computesvc.utf8_mask import ACCEPT, Utf8Mask, run
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.structured_output import Constraint
from kvtier.tokenizer import build_byte_tokenizer

# Continuation bytes stand for their ranges: where Table 3-7's second-byte ranges start and end.
_CONTINUATIONS = [bytes([b]) for b in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)]
_ENDINGS = [b""] + [
    a + b + c for a in _CONTINUATIONS for b in [b"", *_CONTINUATIONS] for c in [b"", *_CONTINUATIONS]
]


def _decoder_says(data: bytes) -> tuple[bool, bool]:
    """(data is a prefix of well-formed UTF-8, data is well-formed UTF-8), by Python's strict
    decoder: a prefix is one that some continuation bytes complete."""

    def decodes(whole: bytes) -> bool:
        try:
            whole.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    return any(decodes(data + end) for end in _ENDINGS), decodes(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=12) | st.lists(st.sampled_from([0x41, 0x80, 0x9F, 0xA0, 0xBF, 0xC2, 0xE0, 0xED, 0xF0, 0xF4]), max_size=8).map(bytes))  # fmt: skip
def test_the_automaton_agrees_with_a_strict_decoder(data):
    prefix_ok, whole_ok = _decoder_says(data)
    state = run(ACCEPT, data)
    assert (state >= 0) == prefix_ok, data.hex()
    assert (state == ACCEPT) == whole_ok, data.hex()


@pytest.mark.parametrize(
    "data",
    [b"\x80", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80", b"\xe0\x9f", b"\xed\xa0", b"\xed\xbf", b"\xf0\x8f",
     b"\xf4\x90", b"\xf5", b"\xff", b"a\xbf"],
)  # fmt: skip
def test_overlongs_surrogates_stray_continuations_and_past_u10ffff_are_refused(data):
    assert run(ACCEPT, data) == -1


# Tokens as a BPE vocabulary holds them: whole characters, pieces of one, pieces across two.
PIECES = [b"a", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xe6\x9d", b"\xb1", b"\xe6\x9d\xb1\xe4", b"\xba\xac",
          b"\xed", b"\x9f", b"\xa0", b"\xf0\x9f", b"\x98\x80", b"\x98", b"\x80", b"\xf4", b"\x8f", b"\x90",
          b"\xe0", b"\xe0\xa0", b"\xbf\xbf", b"\xff", b"", b"\x80a"]  # fmt: skip


def test_the_mask_allows_exactly_the_tokens_that_keep_the_bytes_a_utf8_prefix():
    special = [len(PIECES) - 3]  # b"": an end-of-sequence token
    mask = Utf8Mask(PIECES, special, vocab_size=len(PIECES) + 5)  # 5 ids past the vocabulary
    bits = mask.bitmask
    assert bits.shape == (8, 1) and bits.dtype == np.int32
    for context in (
        b"",
        b"x",
        b"\xc3",
        b"\xe6",
        b"\xe6\x9d",
        b"\xe0",
        b"\xed",
        b"\xf0",
        b"\xf0\x9f\x98",
        b"\xf4",
    ):
        state = run(ACCEPT, context)
        for token, data in enumerate(PIECES + [b""] * 5):
            allowed = bool(int(bits[state, 0]) >> token & 1)
            if not data or token in special:  # ends or control tokens: only between characters
                assert allowed == (state == ACCEPT), (context, token)
                continue
            assert allowed == _decoder_says(context + data)[0], (context.hex(), data.hex())
            if allowed:
                assert mask.next_state(state, token) == run(ACCEPT, context + data)


V, EOS = TINY_LLAMA_CONFIG["vocab_size"], TINY_LLAMA_CONFIG["eos_token_id"]
EDGE_BYTES = (0xE0, 0xED, 0xF0, 0xF4)
NAME = {"type": "string", "minLength": 2, "maxLength": 6}
MODES = {
    "json_schema": Constraint.json_schema({"type": "object", "properties": {"n": NAME}, "required": ["n"]}, "x"),
    "json_object": Constraint("json_object", "", "x"),
    "regex": Constraint("regex", r"[^a-z]{2,6}|.{1,4}", "x"),
    "grammar": Constraint("grammar", 'root ::= "«" [^»]{1,5} "»"', "x"),
    "choice": Constraint("choice", ("東京", "😀", "é"), "x"),
}  # fmt: skip


def _decode_random(grammars, constraint, logits_of, steps, seed) -> tuple[bytes, bool]:
    """Sample from random logits under `constraint`: (the output's bytes, whether it ended)."""
    state = grammars.start(constraint, [])
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        masked = mask_logits(logits_of(gen), [state])
        token = int(torch.multinomial(masked.softmax(-1), 1, generator=gen))
        assert advance([state], [token], {}) == {}
        if state.finished:
            return b"".join(logits_of.vocab[t] for t in out), True
        out.append(token)
    return b"".join(logits_of.vocab[t] for t in out), False


class _EdgeLogits:
    """Random logits over a vocabulary, the tokens starting with an edge lead byte raised."""

    def __init__(self, vocab: list[bytes], size: int):
        self.vocab, self.size = vocab, size
        self.bias = torch.zeros(size)
        for t, data in enumerate(vocab):
            if data and data[0] in EDGE_BYTES:
                self.bias[t] = 3.0

    def __call__(self, gen):
        return (torch.randn(1, self.size, generator=gen) + self.bias).clamp(-20, 20)


def _check(mode: str, text: str) -> None:
    if mode == "json_schema":
        n = json.loads(text)["n"]
        assert 2 <= len(n) <= 6, n  # characters, not bytes
    elif mode == "json_object":
        assert isinstance(json.loads(text), dict)
    elif mode == "regex":
        assert re.fullmatch(r"[^a-z]{2,6}|.{1,4}", text, re.DOTALL), text
    elif mode == "grammar":
        assert re.fullmatch(r"«[^»]{1,5}»", text, re.DOTALL), text
    else:
        assert text in ("東京", "😀", "é")


def _grammars(tokenizer, size: int, eos: int):
    """The replica's Grammars over `tokenizer`, and edge-steered logits over the bytes of its tokens
    as xgrammar reads them."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=[eos])
    return Grammars(tokenizer, size, [eos]), _EdgeLogits(info.decoded_vocab, size)


@pytest.fixture(scope="module")
def byte_level():
    return _grammars(build_byte_tokenizer(), V, EOS)


@pytest.fixture(scope="module")
def byte_fallback():
    """A SentencePiece-style tokenizer: <0xXX> byte tokens beside whole characters and words."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    words = ["▁", "a", "b", "é", "東", "京", "東京", "▁é", "ab", "»", "«"]
    vocab |= {w: len(vocab) + i for i, w in enumerate(words)}
    model = models.BPE(
        vocab=vocab, merges=[("東", "京"), ("▁", "é"), ("a", "b")], byte_fallback=True, unk_token="<unk>"
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return _grammars(hf, len(vocab), 2)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("vocab", ["byte_level", "byte_fallback"])
def test_random_logits_under_every_mode_decode_as_strict_utf8(request, vocab, mode):
    grammars, logits_of = request.getfixturevalue(vocab)
    ended = 0
    for seed in range(40):
        data, done = _decode_random(grammars, MODES[mode], logits_of, 200, seed)
        assert _decoder_says(data)[0], data  # a cut output: a prefix that more bytes complete
        if done:
            ended += 1
            _check(mode, data.decode())
    assert ended >= (20 if mode == "json_object" else 40), ended  # json_object may run past 200 tokens


def test_a_grammar_that_allows_only_surrogates_fails_its_request_naming_why(byte_level):
    grammars, _ = byte_level
    state = grammars.start(Constraint("regex", "[\\uD800-\\uDFFF]", "guided_regex"), [])
    first = mask_logits(torch.zeros(1, V), [state])
    assert torch.isfinite(first[0]).nonzero().flatten().tolist() == [0xED]
    assert advance([state], [0xED], {}) == {}
    assert not torch.isfinite(mask_logits(torch.zeros(1, V), [state])).any()
    assert advance([state], [-1], {0: "sampling failed"}) == {
        0: "the request's grammar allows no token here that keeps the output well-formed UTF-8"
    }


def test_a_resumed_output_that_breaks_utf8_is_refused(byte_level):
    grammars, _ = byte_level
    with pytest.raises(ValueError, match=r"resume_token_ids\[1\] = 160 does not match"):
        grammars.start(Constraint("regex", ".{1,4}", "guided_regex"), [0xED, 0xA0])
