"""Grammar libraries for structured outputs on this machine: xgrammar against llguidance.

For each of two tokenizers (the tiny model's byte tokenizer, 258 tokens; a 32k byte-level BPE
trained here on the installed Python packages' sources, a real vocabulary's size, no download)
and each library: the tokenizer's preparation, the compile time of a JSON schema (a person: a
bounded string, an integer, an enum array, a boolean) and of "any JSON object", then walking a
valid document token by token: the time to fill the next-token bitmask and apply it to a logits
row, median and worst over the document's tokens. Each library must accept the document.

    python bench/grammar_libs.py          # needs `pip install xgrammar llguidance`

Why kvtier uses xgrammar: docs/architecture.md, "Structured outputs and tools". The last line is
the headline.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
# Both libraries write ", " and ": " between items without free whitespace (as kvtier compiles).
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "ok": True})


def bpe_32k():
    """A 32k byte-level BPE trained on site-packages sources (~15 s), as a transformers tokenizer."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(str(Path(tokenizers.__file__).parents[1] / "**" / "*.py"), recursive=True))[
        :4000
    ]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train(
        files,
        trainers.BpeTrainer(vocab_size=32000, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk(ids: list[int], vocab: int, fill, apply, accept) -> list[float]:
    """Seconds of fill + apply before each token of the document; `accept` must take every token."""
    bitmask_logits = torch.randn(1, vocab)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        apply(bitmask_logits, fill())
        times.append(time.perf_counter() - t0)
        if not accept(token):
            raise RuntimeError(f"the grammar refused token {token} of a valid document")
    return times


def xgrammar_run(hf, vocab: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    info, t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, t_schema = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    _, t_object = timed(lambda: compiler.compile_json_schema('{"type": "object"}', any_whitespace=False))
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)

    def fill():
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    times = walk(ids, vocab, fill, xgr.apply_token_bitmask_inplace, matcher.accept_token)
    return {"prepare_s": t_info, "schema_s": t_schema, "object_s": t_object, "times": times}


def llguidance_run(hf, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    tok, t_info = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab))
    defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_json_schema
    matcher, t_schema = timed(lambda: llguidance.LLMatcher(tok, grammar(SCHEMA, defaults=defaults)))
    _, t_object = timed(lambda: llguidance.LLMatcher(tok, grammar({"type": "object"}, defaults=defaults)))
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    bitmask = lt.allocate_token_bitmask(1, vocab)

    def fill():
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask

    times = walk(ids, vocab, fill, lt.apply_token_bitmask_inplace, matcher.consume_token)
    return {"prepare_s": t_info, "schema_s": t_schema, "object_s": t_object, "times": times}


def main() -> int:
    from kvtier.tokenizer import build_byte_tokenizer

    tokenizers = {"byte (258)": build_byte_tokenizer(), "bpe 32k": bpe_32k()}
    rows = {}
    print(
        f"{'tokenizer':>10} {'library':>10} {'prepare ms':>11} {'schema ms':>10} {'object ms':>10} {'mask us p50':>12} {'worst ms':>9}"
    )
    for tname, hf in tokenizers.items():
        vocab, ids = len(hf), hf.encode(DOC, add_special_tokens=False)
        for lname, run in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
            r = run(hf, vocab, ids)
            rows[(tname, lname)] = r
            print(
                f"{tname:>10} {lname:>10} {1e3 * r['prepare_s']:>11.1f} {1e3 * r['schema_s']:>10.1f} "
                f"{1e3 * r['object_s']:>10.1f} {1e6 * statistics.median(r['times']):>12.1f} {1e3 * max(r['times']):>9.1f}"
            )
    byte_x, byte_l = rows[("byte (258)", "xgrammar")], rows[("byte (258)", "llguidance")]
    print(
        f"headline: byte vocabulary, mask per token p50 xgrammar {1e6 * statistics.median(byte_x['times']):.1f} us vs "
        f"llguidance {1e6 * statistics.median(byte_l['times']):.1f} us, worst token {1e3 * max(byte_x['times']):.1f} "
        f"vs {1e3 * max(byte_l['times']):.1f} ms; 32k BPE p50 "
        f"{1e6 * statistics.median(rows[('bpe 32k', 'xgrammar')]['times']):.1f} vs "
        f"{1e6 * statistics.median(rows[('bpe 32k', 'llguidance')]['times']):.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
