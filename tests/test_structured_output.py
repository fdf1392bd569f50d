"""Structured outputs and forced tool calls: the grammar mask in the sampler, and end to end.

Unit tests drive computesvc.structured_output with the built-in byte tokenizer (no model). The
end-to-end tests run one stack (cache service, one replica, the gateway as a real process with
--tool-call-parser hermes) and talk to it with the official `openai` client: every constrained
output is parsed and validated (jsonschema), also for tools forced by tool_choice and for a tool
call the model is scripted to write (a grammar forces its text; the gateway parses it).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch
from servers import EDGE_API_KEY

from kvtier.computesvc.structured_output import Grammars, advance, choice_grammar, mask_logits
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.structured_output import MAX_CONSTRAINT_BYTES, Constraint, from_proto, to_proto
from kvtier.tokenizer import build_byte_tokenizer

VOCAB = TINY_LLAMA_CONFIG["vocab_size"]
EOS = TINY_LLAMA_CONFIG["eos_token_id"]
API_KEY = EDGE_API_KEY
MODEL = "kvtier-tiny"
# Every value bounded, so a random model's output ends well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "member"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


# --- the mask ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(build_byte_tokenizer(), VOCAB, [EOS])


def _run(grammars, constraints, steps=120, seed=0):
    """Greedy-decode random logits under `constraints` (None = unconstrained); the outputs' ids."""
    states = [None if c is None else grammars.start(c, []) for c in constraints]
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in constraints]
    for _ in range(steps):
        logits = torch.randn(len(constraints), VOCAB, generator=gen)
        masked = mask_logits(logits, states)
        for i, s in enumerate(states):
            if s is None:  # unconstrained rows are left exactly as they were
                assert torch.equal(masked[i], logits[i])
        tokens = masked.argmax(-1).tolist()
        assert advance(states, tokens, {}) == {}
        for out, t in zip(outs, tokens, strict=True):
            if not out or out[-1] != EOS:
                out.append(t)
    return outs


def test_the_mask_constrains_only_its_rows_and_ends_with_eos_where_the_grammar_accepts(grammars):
    tok = build_byte_tokenizer()
    constraints = [
        Constraint.json_schema(PERSON, "response_format"),
        None,
        Constraint("choice", ("yes", "no"), "guided_choice"),
        Constraint("regex", "[a-c]{3}", "guided_regex"),
    ]
    outs = _run(grammars, constraints)
    for out, c in zip(outs, constraints, strict=True):
        if c is not None:
            assert out[-1] == EOS, c
    jsonschema.validate(json.loads(tok.decode(outs[0][:-1])), PERSON)
    assert tok.decode(outs[2][:-1]) in ("yes", "no")
    assert re.fullmatch("[a-c]{3}", tok.decode(outs[3][:-1]))


def test_eos_is_masked_until_the_grammar_accepts(grammars):
    state = grammars.start(Constraint("regex", "ab", "guided_regex"), [])
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0  # the model wants to stop at once
    assert mask_logits(logits, [state]).argmax(-1).item() == ord("a")
    assert state.accept(ord("a"))
    assert mask_logits(logits, [state]).argmax(-1).item() == ord("b")
    assert state.accept(ord("b"))
    allowed = torch.isfinite(mask_logits(torch.zeros(1, VOCAB), [state])[0]).nonzero().flatten().tolist()
    assert allowed == [EOS]
    assert state.accept(EOS) and state.finished


def test_a_batch_without_constraints_is_passed_through_untouched(grammars):
    logits = torch.randn(3, VOCAB)
    assert mask_logits(logits, [None, None, None]) is logits


def test_resumed_output_is_replayed_and_checked(grammars):
    c = Constraint("choice", ("yes", "no"), "guided_choice")
    state = grammars.start(c, [ord("y"), ord("e")])
    allowed = torch.isfinite(mask_logits(torch.zeros(1, VOCAB), [state])[0]).nonzero().flatten().tolist()
    assert allowed == [ord("s")]
    with pytest.raises(ValueError, match=r"guided_choice: resume_token_ids\[1\] = 120"):
        grammars.start(c, [ord("y"), ord("x")])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            Constraint("regex", "a(b", "guided_regex"),
            "guided_regex: the regex does not compile: .*parenthesis",
        ),
        (
            Constraint("json_schema", '{"type": "nope"}', "response_format"),
            'response_format: .*Unsupported type "nope"',
        ),
        (
            Constraint("grammar", "root ::= undefined_rule", "guided_grammar"),
            "guided_grammar: the grammar does not compile",
        ),
        (
            Constraint("json_schema", "{not json", "guided_json"),
            "guided_json: the JSON schema is not valid JSON",
        ),
        (Constraint("choice", (), "guided_choice"), "guided_choice: give a non-empty list"),
        (
            Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1), "guided_regex"),
            f"at most {MAX_CONSTRAINT_BYTES}",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(grammars, constraint, message):
    with pytest.raises(ValueError, match=message):
        grammars.compile(constraint)


def test_constraints_round_trip_the_wire_and_choices_are_escaped(grammars):
    for c in (
        Constraint.json_schema(PERSON, "response_format"),
        Constraint("json_object", "", "response_format"),
        Constraint("regex", "x+", "guided_regex"),
        Constraint("choice", ("a", 'b"\\'), "guided_choice"),
    ):
        assert from_proto(to_proto(c)) == c
    outs = _run(grammars, [Constraint("choice", ('say "hi"\\',), "guided_choice")], steps=12)
    assert build_byte_tokenizer().decode(outs[0][:-1]) == 'say "hi"\\'
    # Non-ASCII as itself: xgrammar reads "\\ud83d\\ude00" as two surrogates, not one emoji.
    assert choice_grammar(("é", "😀")) == 'root ::= "é" | "😀"'
    outs = _run(grammars, [Constraint("choice", ("😀",), "guided_choice")], steps=6)
    assert build_byte_tokenizer().decode(outs[0][:-1]) == "😀" and len(outs[0]) == 5  # 4 bytes, eos


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(edge_gateway):
    """The official client on conftest's shared `edge_gateway` (hermes, the default tool-call parser)."""
    return openai.OpenAI(
        base_url=f"{edge_gateway.gateway.address}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


CHAT = [{"role": "user", "content": "Tell me about someone."}]


@pytest.mark.slow
def test_json_schema_strict_output_validates_for_20_seeded_requests(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(20):
        reply = client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=fmt, seed=seed, temperature=1.0, max_tokens=200
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_vllm_guided_fields_and_json_object_on_completions(client):
    def complete(**extra):
        reply = client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=64, temperature=0.8, seed=3, extra_body=extra
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
        return reply.choices[0].text

    assert complete(guided_choice=["alpha", "beta", "gamma"]) in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"\d{3}-[a-z]{2}", complete(guided_regex=r"\d{3}-[a-z]{2}"))
    assert complete(structured_outputs={"grammar": 'root ::= "x" ("y" | "z")'}) in ("xy", "xz")
    jsonschema.validate(
        json.loads(
            complete(
                guided_json={
                    "type": "object",
                    "properties": {"n": {"type": "integer", "maximum": 9, "minimum": 0}},
                    "required": ["n"],
                    "additionalProperties": False,
                }
            )
        ),
        {"type": "object"},
    )
    obj = client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=400,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    ).choices[0]
    if obj.finish_reason == "stop":  # a random model may nest deeper than max_tokens allows
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ],
)
def test_an_invalid_constraint_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.slow
def test_a_named_tool_calls_arguments_validate_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = WEATHER["function"]["parameters"]
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100, seed=1
    )
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=100,
            seed=1,
            stream=True,
        )
    )
    name, args, reasons = _assemble(chunks)
    assert name == {0: "get_weather"} and reasons == ["tool_calls"]
    assert args[0] == call.function.arguments  # same seed, same arguments


@pytest.mark.slow
def test_tool_choice_required_calls_valid_tools(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=300, seed=5
    )
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# The model is scripted to write a Hermes tool call (a grammar forces the text); tool_choice auto.
SCRIPTED = (
    'root ::= "Let me check. <tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": " city '
    '", \\"days\\": 2}}</tool_call>"\ncity ::= "\\"Paris\\"" | "\\"Oslo\\""'
)


@pytest.mark.slow
def test_an_auto_tool_call_in_the_output_is_parsed_and_streamed_in_deltas(client):
    kw = dict(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER],
        max_tokens=120,
        seed=2,
        extra_body={"guided_grammar": SCRIPTED},
    )
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check. "
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    name, args, reasons = _assemble(chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == "Let me check. " and name == {0: "get_weather"} and reasons == ["tool_calls"]
    assert json.loads(args[0]) == json.loads(call.function.arguments)
    heads = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or [] if d.id]
    assert len(heads) == 1 and heads[0].type == "function"  # the call's head comes once, with its id


def _assemble(chunks):
    """({index: name}, {index: arguments}, finish reasons) of a streamed chat's tool-call deltas."""
    names, args, reasons = {}, {}, []
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return names, args, reasons


@pytest.mark.slow
def test_the_chat_template_gets_the_tools_and_a_tool_conversation_renders(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    # The fallback template writes the tools as JSON on a line of their own (one byte, one token).
    added = len("<|tools|>\n" + json.dumps([WEATHER]) + "\n")
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens == added
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    turn = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER], max_tokens=4)
    assert reply.usage.prompt_tokens > with_tools.usage.prompt_tokens
