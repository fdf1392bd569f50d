"""Output processing (computesvc.output): incremental detokenization and stop checks, in-process.

The built-in tiny model's tokenizer is byte-level (token b is byte b, bos 256, eos 257), so a
multi-byte UTF-8 character arrives over several tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.computesvc.output import CONTEXT_TOKENS, WINDOW_TOKENS, OutputProcessor
from kvtier.computesvc.request import Request
from kvtier.computesvc.sampling import SamplingParams
from kvtier.tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()
BOS, EOS = 256, 257
MAX_MODEL_LEN = 100_000


def stream(processor: OutputProcessor, output: list[int], **params) -> tuple[list[str], str, int]:
    """Feed `output` token by token: (text pieces streamed, finish reason, tokens consumed)."""
    req = Request("r", [BOS], SamplingParams(**({"max_tokens": len(output), "ignore_eos": True} | params)))
    pieces = []
    for token in output:
        req.output_token_ids.append(token)
        reason, text = processor.process(req, token, MAX_MODEL_LEN)
        pieces.append(text)
        if reason:
            return pieces, reason, len(req.output_token_ids)
    return pieces, "", len(req.output_token_ids)


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. " * 3,
    "multi-byte": "naïve café — 東京 🙂 Ωμέγα " * 4,  # 2-, 3- and 4-byte characters
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_pieces_concatenate_to_decoding_all_tokens(text):
    output = byte_tokens(text)
    pieces, reason, _ = stream(OutputProcessor(TOKENIZER, [EOS]), output)
    assert reason == "length"
    assert "".join(pieces) == TOKENIZER.decode(output, skip_special_tokens=True)


def test_an_output_ending_mid_character_flushes_what_decode_gives():
    output = byte_tokens("ok ") + list("€".encode()[:2])
    pieces, reason, _ = stream(OutputProcessor(TOKENIZER, [EOS]), output)
    assert reason == "length"
    assert pieces[-1] == "\ufffd"  # held while it could still complete; flushed at the end
    assert "".join(pieces) == TOKENIZER.decode(output) == "ok \ufffd"


def test_a_character_split_across_tokens_is_never_streamed_half():
    text = TEXTS["multi-byte"]
    pieces, _, _ = stream(OutputProcessor(TOKENIZER, [EOS]), byte_tokens(text))
    assert not any("\ufffd" in piece for piece in pieces)
    # A 4-byte character streams whole, with its last byte, and nothing before that.
    emoji = pieces[text.encode().index("🙂".encode()) :][:4]
    assert emoji == ["", "", "", "🙂"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=4 * WINDOW_TOKENS))
def test_any_bytes_even_invalid_utf8_stream_exactly_what_decode_gives(output):
    pieces, _, _ = stream(OutputProcessor(TOKENIZER, [EOS]), output)
    assert "".join(pieces) == TOKENIZER.decode(output)


def test_a_stop_string_within_one_token_is_cut_with_the_rest_of_the_token(word_tokenizer):
    pieces, reason, consumed = stream(
        OutputProcessor(word_tokenizer, [EOS]), word_tokenizer.ids("Hello", " world. Bye", "!"), stop=["."]
    )
    assert (reason, consumed) == ("stop", 2)
    assert pieces == ["Hello", " world"]


def test_a_stop_string_spanning_two_tokens_is_caught_and_what_follows_is_cut(word_tokenizer):
    output = word_tokenizer.ids("Hel", "lo w", "orld!", " more")
    pieces, reason, consumed = stream(OutputProcessor(word_tokenizer, [EOS]), output, stop=["zz", "wor"])
    assert (reason, consumed) == ("stop", 3)
    # "w" could begin "wor": it is held back, and never streamed once "orld" completes the stop.
    assert pieces == ["Hel", "lo ", ""]


def test_held_text_that_does_not_become_a_stop_string_is_streamed_when_it_cannot(word_tokenizer):
    output = word_tokenizer.ids("Hel", "lo w", "ay", " out")
    pieces, reason, _ = stream(OutputProcessor(word_tokenizer, [EOS]), output, stop=["wor", "lo wz"])
    assert reason == "length"
    # "l" could begin "lo wz", then "lo w" could: each is held until the next token rules it out.
    assert pieces == ["He", "l", "lo way", " out"]


def test_the_issue_example_ends_before_the_stop_string_with_no_part_of_it():
    # Built-in model, stop "gB" (issue 26): the text streamed "B\ufffdg" (the g leaked) before.
    output = byte_tokens("aB") + [0xFF] + byte_tokens("gBz")
    pieces, reason, _ = stream(OutputProcessor(TOKENIZER, [EOS]), output, stop=["gB"])
    assert reason == "stop" and "".join(pieces) == "aB\ufffd"
    pieces, reason, _ = stream(
        OutputProcessor(TOKENIZER, [EOS]), output, stop=["gB"], include_stop_str_in_output=True
    )
    assert reason == "stop" and "".join(pieces) == "aB\ufffdgB"


def test_the_earliest_stop_string_wins_and_a_length_finish_flushes_held_text(word_tokenizer):
    output = word_tokenizer.ids("ab", "cd")
    pieces, reason, _ = stream(OutputProcessor(word_tokenizer, [EOS]), output, stop=["cd", "bc"])
    assert (reason, "".join(pieces)) == ("stop", "a")
    pieces, reason, _ = stream(OutputProcessor(word_tokenizer, [EOS]), output[:1], stop=["bx"])
    assert (reason, pieces) == ("length", ["ab"])  # "b" held, then flushed with the finish


@settings(max_examples=200, deadline=None)
@given(st.text("ab", min_size=1, max_size=40), st.lists(st.text("ab", min_size=1, max_size=4), max_size=3))
def test_streamed_text_is_the_whole_text_cut_at_the_first_stop_string(text, stops):
    pieces, reason, _ = stream(OutputProcessor(TOKENIZER, [EOS]), byte_tokens(text), stop=stops)
    # The first character (token) that completes a stop string ends the text, before that string.
    ends = (i for i in range(1, len(text) + 1) if any(text[:i].endswith(s) for s in stops))
    end = next(ends, None)
    if end is None:
        assert ("".join(pieces), reason) == (text, "length")
    else:
        longest = max(len(s) for s in stops if text[:end].endswith(s))
        assert ("".join(pieces), reason) == (text[: end - longest], "stop")


def test_a_stop_string_of_one_multibyte_character_is_never_streamed():
    output = byte_tokens("a€b")
    pieces, reason, consumed = stream(OutputProcessor(TOKENIZER, [EOS]), output, stop=["€"])
    assert (reason, consumed) == ("stop", 4)
    assert "".join(pieces) == "a"


def test_eos_and_stop_token_ids_finish_with_stop():
    processor = OutputProcessor(TOKENIZER, [EOS])
    pieces, reason, consumed = stream(processor, [*byte_tokens("hi"), EOS, 65], ignore_eos=False)
    assert (reason, consumed, "".join(pieces)) == ("stop", 3, "hi")
    pieces, reason, consumed = stream(processor, byte_tokens("a\nb"), stop_token_ids=[ord("\n")])
    assert (reason, consumed, "".join(pieces)) == ("stop", 2, "a\n")


def test_decode_work_per_token_is_bounded_however_long_the_output():
    decoded_lengths: list[list[int]] = []  # per token: the lengths of the id lists decoded

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            decoded_lengths[-1].append(len(ids))
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    processor = OutputProcessor(CountingTokenizer(), [EOS])
    output = byte_tokens(TEXTS["multi-byte"] * 20)  # ~2000 tokens
    req = Request("r", [BOS], SamplingParams(max_tokens=len(output), ignore_eos=True))
    pieces = []
    for token in output:
        decoded_lengths.append([])
        req.output_token_ids.append(token)
        pieces.append(processor.process(req, token, MAX_MODEL_LEN)[1])
    assert "".join(pieces) == TOKENIZER.decode(output)
    assert max(sum(lengths) for lengths in decoded_lengths) <= WINDOW_TOKENS + CONTEXT_TOKENS
    assert max(len(lengths) for lengths in decoded_lengths) <= 2


class WordTokenizer:
    """A tokenizer whose tokens are whole strings (as BPE tokens are), for stop strings that
    fall inside one token or across two."""

    def __init__(self):
        self.vocab: list[str] = []

    def ids(self, *pieces: str) -> list[int]:
        self.vocab += pieces
        return list(range(len(self.vocab) - len(pieces), len(self.vocab)))

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    return WordTokenizer()


@pytest.mark.parametrize("cut", range(1, 9))
def test_a_resumed_request_streams_what_the_uninterrupted_one_would_held_text_included(cut):
    output = byte_tokens("xaby abz abc")
    stops = ["abc", "y b"]
    whole, reason, consumed = stream(OutputProcessor(TOKENIZER, [EOS]), output, stop=stops)
    # The first attempt delivered `cut` tokens (what it streamed of them), then failed over.
    first = stream(OutputProcessor(TOKENIZER, [EOS]), output[:cut], stop=stops, max_tokens=len(output))[0]
    processor = OutputProcessor(TOKENIZER, [EOS])
    req = Request("r", [BOS], SamplingParams(max_tokens=len(output), ignore_eos=True, stop=stops))
    req.output_token_ids = list(output[:cut])
    processor.resume(req)
    rest = []
    for token in output[cut:consumed]:
        req.output_token_ids.append(token)
        rest.append(processor.process(req, token, MAX_MODEL_LEN)[1])
    assert "".join(first) + "".join(rest) == "".join(whole) == "xaby abz "
