"""Generate's per-token logprobs (GenerateResponse.logprobs) -> OpenAI's two response shapes.

Completions (legacy): parallel lists `tokens`, `token_logprobs`, `top_logprobs` ({text: logprob}
of the k most likely tokens plus the sampled one, as vLLM returns) and `text_offset`. Chat: one
entry per token with its text, logprob, UTF-8 bytes and the k most likely alternatives.

A token's text is its id decoded alone by the gateway's tokenizer (a character split across
byte-level tokens decodes to U+FFFD in each piece, as in vLLM's and OpenAI's responses).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.api import compute_pb2
from kvtier.gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> text; the vocabulary is fixed, so it only grows

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion(
        self, token_ids: Sequence[int], logprobs: Sequence[compute_pb2.TokenLogprobs], offset: int = 0
    ) -> tuple[CompletionLogprobs, int]:
        """The completions shape of these tokens, whose text starts `offset` characters into the
        completion; and the offset after them (a stream's next chunk starts there)."""
        tokens, offsets, tops = [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {self.text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            top.setdefault(text, lp.logprob)
            tops.append(top)
        out = CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=tops,
            text_offset=offsets,
        )
        return out, offset

    def chat(self, token_ids: Sequence[int], logprobs: Sequence[compute_pb2.TokenLogprobs]) -> ChatLogprobs:
        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.text(token_id)
            top = [
                TopLogprob(token=self.text(t), logprob=v, bytes=list(self.text(t).encode()))
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ]
            content.append(
                ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top)
            )
        return ChatLogprobs(content=content)
