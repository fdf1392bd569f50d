"""Tool calls in the gateway (gateway.tools): the parsers on scripted model output, the plans of
tool_choice, and the streamed deltas adding up to the whole response. End-to-end tool calls
against a running stack are in tests/test_structured_output.py (they share its stack)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvtier.gateway.config import build_parser
from kvtier.gateway.errors import APIError
from kvtier.gateway.tools import PARSERS, HermesParser, Llama3JsonParser, ToolOutput, ToolPlan, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TEXT = (
    'Checking both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA_TEXT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'


def test_hermes_parser_reads_calls_and_keeps_the_text_around_them():
    content, calls = HermesParser().parse(HERMES_TEXT)
    assert content == "Checking both. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # A block that is not a call stays content; an unclosed last block with whole JSON counts.
    assert HermesParser().parse("a <tool_call>not json</tool_call> b") == (
        "a <tool_call>not json</tool_call> b",
        [],
    )
    content, calls = HermesParser().parse('x<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content == "x" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}


def test_llama3_json_parser_reads_a_leading_call_or_several():
    content, calls = Llama3JsonParser().parse(LLAMA_TEXT)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert Llama3JsonParser().parse("The answer is {1}") == ("The answer is {1}", [])
    assert Llama3JsonParser().parse('{"name": "f", "parameters": {"a": ') == (
        '{"name": "f", "parameters": {"a": ',
        [],
    )
    assert Llama3JsonParser().parse('{"no_name": 1}') == ('{"no_name": 1}', [])


def test_the_gateway_flag_offers_every_parser():
    action = next(a for a in build_parser()._actions if a.dest == "tool_call_parser")
    assert set(action.choices) == set(PARSERS)


def _stream(plan: ToolPlan, text: str, pieces: int = 3) -> tuple[str | None, list[dict]]:
    """Feed `text` in pieces of `pieces` characters; (content, calls) the deltas add up to."""
    out = ToolOutput(plan)
    deltas = []
    for i in range(0, len(text), pieces):
        deltas += out.feed(text[i : i + pieces])
    deltas += out.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            assert len(d["tool_calls"]) == 1
            call = calls.setdefault(entry["index"], {"name": None, "arguments": "", "id": None})
            if "id" in entry:
                assert call["id"] is None, "a call's head is sent once"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("pieces", [1, 4, 1000])
@pytest.mark.parametrize(("parser", "text"), [("hermes", HERMES_TEXT), ("llama3_json", LLAMA_TEXT)])
def test_streamed_tool_call_deltas_add_up_to_the_whole_response(parser, text, pieces):
    plan = plan_tools([WEATHER, TIME], "auto", parser)
    content, calls, reason = ToolOutput(plan).whole(text, "stop")
    assert reason == "tool_calls" and len(calls) == 2
    streamed_content, streamed = _stream(plan, text, pieces)
    assert streamed_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_plain_text_streams_as_content_under_auto(parser):
    plan = plan_tools([WEATHER], None, parser)  # tools without tool_choice: auto
    assert plan.mode == "auto"
    text = "It is sunny in <b>Paris</b> today, no tool < needed."
    assert _stream(plan, text) == (text, [])
    out = ToolOutput(plan)
    assert out.feed("It is") == [{"content": "It is"}]  # content is not held back for nothing
    assert ToolOutput(plan).whole(text, "stop") == (text, None, "stop")


def test_named_and_required_plans_constrain_the_output_to_valid_calls():
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.constraint.param == "tool_choice"
    assert json.loads(named.constraint.value) == WEATHER["function"]["parameters"]
    content, calls, reason = ToolOutput(named).whole('{"city": "Rome"}', "stop")
    assert content is None and reason == "tool_calls"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    streamed_content, streamed = _stream(named, '{"city": "Rome"}')
    assert streamed_content is None and streamed[0]["name"] == "get_weather"
    assert streamed[0]["arguments"] == '{"city": "Rome"}'

    required = plan_tools([WEATHER, TIME], "required")
    schema = json.loads(required.constraint.value)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls, reason = ToolOutput(required).whole(json.dumps(good), "stop")
    assert content is None and reason == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert _stream(required, json.dumps(good))[1][1]["name"] == "get_time"
    # Cut short by max_tokens: text, no calls, the length reason.
    assert ToolOutput(required).whole('[{"name": "get_w', "length") == ('[{"name": "get_w', None, "length")


def test_tool_choice_none_and_no_tools():
    plan = plan_tools([WEATHER], "none")
    assert not plan.active and plan.tools == [WEATHER] and plan.constraint is None
    assert not plan_tools(None, None).active
    assert ToolOutput(plan).whole(HERMES_TEXT, "stop") == (HERMES_TEXT, None, "stop")


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
        ([{"type": "retrieval"}], None, "tools.0"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0.function.name"),
        ([WEATHER, WEATHER], None, "tools.1.function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools.0.function.parameters",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice)
    assert e.value.status == 400 and e.value.info.param == param
