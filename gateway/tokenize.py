"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, for counting tokens.

/tokenize takes a completion prompt (`prompt`, with the special tokens a completion adds unless
`add_special_tokens: false`) or a conversation (`messages`, rendered with the chat template
exactly as /v1/chat/completions renders it) and answers the token ids, their count and the
model's context; /detokenize answers the text of token ids. Same limits as generation (the
prompt's bytes, ids within the vocabulary), same off-loop tokenizing, same errors.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import Response

from kvtier.gateway.errors import bad_request
from kvtier.gateway.limits import check_fields, check_model, off_loop
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


def tokenize_routes(model: ServedModel, chat_prompt: Callable[..., list[int]]) -> APIRouter:
    """The two routes over `model`'s tokenizer (the app adds its API-key check). `chat_prompt(req,
    model, tools)`: the app's rendering of a chat request's messages to token ids."""
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        check_model(req.model, model)
        if isinstance(req, TokenizeChatRequest):
            chat = ChatCompletionRequest(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            check_fields(chat, model)
            ids = await off_loop(chat_prompt, chat, model, req.tools)
        else:
            check_fields(CompletionRequest(prompt=req.prompt), model)
            ids = await off_loop(_encode, model, req.prompt, req.add_special_tokens)
        strs = model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        reply = TokenizeResponse(
            count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs
        )
        return Response(reply.json_bytes(), media_type="application/json")

    @routes.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        check_model(req.model, model)
        vocab = model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        if len(req.tokens) > model.max_model_len:
            raise bad_request(
                f"tokens has {len(req.tokens)} ids, more than the model's context ({model.max_model_len})",
                param="tokens",
            )
        text = await off_loop(model.tokenizer.decode, req.tokens)
        return Response(DetokenizeResponse(prompt=text).json_bytes(), media_type="application/json")

    return routes


def _encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    return (
        model.encode(text)
        if add_special_tokens
        else list(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    )
