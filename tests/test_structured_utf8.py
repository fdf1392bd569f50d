"""Every structured output is well-formed UTF-8, and its lengths count characters (issue 31).

The built-in tiny model's tokens are bytes, so a grammar alone would let it write any byte its
character classes loosely admit: surrogates (ED A0..BF ..), overlong forms (E0 80.., F0 80..8F ..)
and, after them, U+FFFD in the text and a maxLength overrun. Each constrained mode (json_schema,
json_object, regex, choice, grammar, tools) gets 40 seeded requests through the gateway's HTTP
API with the official `openai` client, on conftest's shared `edge_gateway` stack. The model is
nudged (logit_bias) toward the lead bytes whose next byte has invalid choices (E0, ED, F0, F4),
so that every request walks those edges. Every output must hold no U+FFFD, encode as strict
UTF-8, validate (jsonschema, the regex, the choices) and keep its lengths in characters.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from servers import EDGE_API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "kvtier-tiny"
SEEDS = range(40)
CHAT = [{"role": "user", "content": "Écris-moi quelque chose."}]
# Lead bytes of 3- and 4-byte characters whose second byte is restricted (Unicode Table 3-7).
EDGES = {str(b): 3 for b in (0xE0, 0xED, 0xF0, 0xF4)}
CITIES = ["Zürich", "東京", "São Paulo", "😀 ok"]
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 20},
        "città": {"type": "string", "enum": CITIES},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "città", "tags"],
    "additionalProperties": False,
}
REGEX = r"(café|東京) .{4,16}"
GRAMMAR = 'root ::= "«" word (" " word){0,2} "»"\nword ::= [^\\x00-\\x20"«»]{1,8}'
GRAMMAR_AS_REGEX = r'«[^\x00-\x20"«»]{1,8}( [^\x00-\x20"«»]{1,8}){0,2}»'
CHOICES = ["café", "東京", "😀", "naïve façade", "Zürich"]
BOOK = {
    "type": "function",
    "function": {
        "name": "reserver",
        "parameters": {
            "type": "object",
            "properties": {
                "ville": {"type": "string", "enum": CITIES},
                "note": {"type": "string", "minLength": 1, "maxLength": 12},
            },
            "required": ["ville", "note"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "chercher",
        "parameters": {
            "type": "object",
            "properties": {"mot": {"type": "string", "maxLength": 10}},
            "required": ["mot"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (BOOK, LOOKUP)}


def _check_json_schema(choice) -> None:
    value = json.loads(choice.message.content)
    jsonschema.validate(value, PROFILE)  # maxLength/minLength in code points, as JSON Schema says
    assert 3 <= len(value["name"]) <= 20 and all(len(t) <= 8 for t in value["tags"])


def _check_json_object(choice) -> None:
    assert isinstance(json.loads(choice.message.content), dict)


def _check_regex(choice) -> None:
    assert re.fullmatch(REGEX, choice.message.content, re.DOTALL), choice.message.content


def _check_grammar(choice) -> None:
    assert re.fullmatch(GRAMMAR_AS_REGEX, choice.message.content), choice.message.content


def _check_choice(choice) -> None:
    assert choice.message.content in CHOICES


def _check_tools(choice) -> None:
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


# mode -> (request fields, max_tokens: room for the longest output the grammar allows, check)
MODES = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE, "strict": True}}},
        300,
        _check_json_schema,
    ),
    # Any JSON object: quotes and closing braces are favoured too, so that objects end.
    "json_object": (
        {"response_format": {"type": "json_object"}, "logit_bias": EDGES | {"34": 3, "125": 5, "93": 5}},
        400,
        _check_json_object,
    ),
    "regex": ({"extra_body": {"guided_regex": REGEX}}, 80, _check_regex),
    "grammar": ({"extra_body": {"guided_grammar": GRAMMAR}}, 120, _check_grammar),
    "choice": ({"extra_body": {"structured_outputs": {"choice": CHOICES}}}, 30, _check_choice),
    # tool_choice required: a list of calls, of any length; its closing bracket is favoured.
    "tools": ({"tools": [BOOK, LOOKUP], "tool_choice": "required", "logit_bias": EDGES | {"93": 4}}, 400, _check_tools),
}  # fmt: skip


@pytest.fixture(scope="module")
def client(edge_gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{edge_gateway.gateway.address}/v1", api_key=EDGE_API_KEY, max_retries=0, timeout=120
    )


def _texts(choice) -> list[str]:
    """Everything the client reads of a choice: its content and each tool call's name and arguments."""
    calls = choice.message.tool_calls or []
    return [choice.message.content or ""] + [c.function.name + c.function.arguments for c in calls]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_constrained_output_is_well_formed_utf8_and_valid(client, mode):
    fields, max_tokens, check = MODES[mode]
    fields = {"logit_bias": EDGES} | fields

    def ask(seed: int):
        reply = client.chat.completions.create(
            model=MODEL, messages=CHAT, seed=seed, temperature=1.0, max_tokens=max_tokens, **fields
        )
        return reply.choices[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the replica batches them
        choices = list(pool.map(ask, SEEDS))
    broken, invalid = [], []
    for seed, choice in zip(SEEDS, choices, strict=True):
        texts = _texts(choice)
        if any("\ufffd" in t for t in texts):
            broken.append((seed, texts))
        for t in texts:
            t.encode("utf-8")  # strict: no lone surrogate either
        try:
            assert choice.finish_reason in ("stop", "tool_calls"), choice.finish_reason
            check(choice)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            invalid.append((seed, texts, str(e).splitlines()[0]))
    print(f"{mode}: {len(broken)} of {len(choices)} outputs hold U+FFFD, {len(invalid)} do not validate")
    assert not broken, broken[:3]
    assert not invalid, invalid[:3]
