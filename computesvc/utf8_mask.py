"""Well-formed UTF-8 as a token mask, laid over a grammar's mask for every constrained request.

A grammar library matches bytes for byte-level and byte-fallback vocabularies, and its character
classes are looser than UTF-8: xgrammar admits surrogates (ED A0..BF ..) in every mode and
overlong forms (E0 80.., F0 80..8F ..) in some. A token sequence is well-formed UTF-8 exactly
when a small automaton over its bytes never fails: the byte ranges of Unicode's Table 3-7
("Well-Formed UTF-8 Byte Sequences"), whose states say which bytes may come next inside a
character. `Utf8Mask` runs every token of a vocabulary through that automaton from each state
once, and keeps, per state, the bitmask of tokens that keep the output well-formed (in
xgrammar's layout: bit j of word i is token 32 * i + j) and the state each token leads to.

A request carries its state (an int, ACCEPT between characters); each step its grammar's
bitmask row is ANDed with its state's row, so the sampler never sees a token that would make the
bytes so far not a prefix of well-formed UTF-8, whatever the grammar or its mode. Tokens without
bytes (special tokens, end of sequence) are allowed only between characters: a sequence never
ends, or takes a control token, inside a character.
"""

from __future__ import annotations

import codecs

import numpy as np
import torch

ACCEPT = 0  # between characters
NUM_STATES = 8
# Inside a character: state -> (lowest, highest) next byte, and the state after it. States 1-3
# need 1-3 more bytes of 80..BF; 4-7 are the lead bytes whose second byte is narrower.
_INSIDE = {
    1: (0x80, 0xBF, ACCEPT),
    2: (0x80, 0xBF, 1),
    3: (0x80, 0xBF, 2),
    4: (0xA0, 0xBF, 1),  # after E0: no overlong 3-byte form
    5: (0x80, 0x9F, 1),  # after ED: no surrogate (U+D800..U+DFFF)
    6: (0x90, 0xBF, 2),  # after F0: no overlong 4-byte form
    7: (0x80, 0x8F, 2),  # after F4: nothing past U+10FFFF
}


def _transitions() -> np.ndarray:
    """[NUM_STATES, 256] int8: the state after a byte, -1 where the byte is not allowed."""
    table = np.full((NUM_STATES, 256), -1, dtype=np.int8)
    table[ACCEPT, 0x00:0x80] = ACCEPT
    table[ACCEPT, 0xC2:0xE0] = 1
    table[ACCEPT, 0xE1:0xF0] = 2
    table[ACCEPT, 0xF1:0xF4] = 3
    table[ACCEPT, 0xE0], table[ACCEPT, 0xED], table[ACCEPT, 0xF0], table[ACCEPT, 0xF4] = 4, 5, 6, 7
    for state, (lo, hi, after) in _INSIDE.items():
        table[state, lo : hi + 1] = after
    return table


TRANSITIONS = _transitions()


def run(state: int, data: bytes) -> int:
    """The state after `data` from `state`; -1 when `data` is not well-formed from there."""
    for byte in data:
        state = int(TRANSITIONS[state, byte])
        if state < 0:
            return -1
    return state


def _from_accept(data: bytes) -> int:
    """`run(ACCEPT, data)` at the speed of Python's UTF-8 decoder (strict: it refuses surrogates
    and overlong forms as Table 3-7 does); the automaton runs only on an unfinished last character."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return -1
    pending = decoder.getstate()[0]
    return run(ACCEPT, pending) if pending else ACCEPT


class Utf8Mask:
    """Per automaton state, the tokens of a vocabulary that keep the output well-formed UTF-8.

    `token_bytes[t]`: token t's bytes as the grammar library matches them (xgrammar's
    `TokenizerInfo.decoded_vocab`); b"" for a token without text. `special_ids`: tokens without
    text whatever their bytes say (end of sequence, control tokens). `vocab_size`: columns of the
    logits (tokens past `token_bytes` are treated as special)."""

    def __init__(self, token_bytes: list[bytes], special_ids: list[int], vocab_size: int):
        ends = np.full((NUM_STATES, vocab_size), -1, dtype=np.int8)  # [state, token] -> state after it
        ends[ACCEPT, :] = ACCEPT  # special tokens and tokens past the list: between characters only
        special = set(special_ids)
        for token, data in enumerate(token_bytes[:vocab_size]):
            if token in special or not data:
                continue
            ends[ACCEPT, token] = _from_accept(data)
            if 0x80 <= data[0] <= 0xBF:  # a continuation byte first: it may go on a character
                for state in range(1, NUM_STATES):
                    ends[state, token] = run(state, data)
        self.ends = ends
        self.vocab_size = vocab_size
        allowed = np.zeros((NUM_STATES, -(-vocab_size // 32) * 32), dtype=bool)
        allowed[:, :vocab_size] = ends >= 0
        packed = np.packbits(allowed, axis=1, bitorder="little")  # bit j of byte k: token 8k + j
        # [NUM_STATES, ceil(vocab / 32)] int32, as xgrammar's bitmask (little-endian words).
        self.bitmask = packed.view("<i4").astype(np.int32)

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`; -1 when it breaks UTF-8 (or is outside the vocabulary)."""
        return int(self.ends[state, token]) if 0 <= token < self.vocab_size else -1

    def restrict(self, bitmask: torch.Tensor, rows: list[int], states: list[int]) -> list[int]:
        """AND bitmask rows `rows` (a CPU tensor [num_seqs, ceil(vocab / 32)] int32, a grammar's
        allowed tokens) with the tokens allowed in `states` (one per row): the rows left without
        any token."""
        # NOTE: in numpy, on the tensor's memory: torch's small CPU ops wait on its thread pool,
        # 2-5 ms each on a busy machine against 0.3 ms here for 64 rows of a 150k vocabulary.
        words, index = bitmask.numpy(), np.asarray(rows)
        restricted = words[index] & self.bitmask[np.asarray(states)]
        words[index] = restricted
        return [rows[i] for i in np.flatnonzero(~restricted.any(axis=1))]
