"""Tool calls in the gateway (gateway.tools): the parsers on scripted model output, the plans of
tool_choice, the streamed deltas adding up to the whole response, and an assistant's tool calls
reaching a Hermes-style chat template as objects (a second gateway on conftest's `edge_gateway`
replicas). End-to-end tool calls are in tests/test_structured_output.py (they share its stack)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from servers import EDGE_API_KEY

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


# --- tool calls in a conversation, through a Hermes-style chat template ---------------------------

# How Hermes, Qwen 2.5 and Llama 3.1 templates write an assistant's calls and a tool's answer.
HERMES_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARGUMENTS = '{"city": "Zürich"}'
SECOND_TURN = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def hermes_gateway(edge_gateway, tmp_path_factory):
    """A second gateway in front of conftest's `edge_gateway` replicas, whose model directory (the
    tiny model's config and byte tokenizer) carries HERMES_TEMPLATE as its chat template."""
    from servers import child_env

    from kvtier.cli.stack import start_gateway
    from kvtier.model_spec import TINY_LLAMA_CONFIG
    from kvtier.tokenizer import build_byte_tokenizer

    model_dir = tmp_path_factory.mktemp("hermes-model")
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_LLAMA_CONFIG}))
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    run_dir = tmp_path_factory.mktemp("hermes-gateway")
    args = ["--model", str(model_dir), "--served-model-name", "kvtier-tiny", "--api-key", EDGE_API_KEY]
    gateway = start_gateway(edge_gateway.compute_addresses, args, run_dir, child_env(run_dir))
    try:
        yield gateway.address
    finally:
        gateway.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {EDGE_API_KEY}"}, timeout=120)


@pytest.mark.slow
def test_a_templates_tool_call_arguments_are_an_object_not_a_json_string(hermes_gateway):
    reply = _post(hermes_gateway, "/tokenize", {"messages": SECOND_TURN, "tools": [WEATHER]})
    assert reply.status_code == 200, reply.text
    ids = reply.json()["tokens"]
    text = _post(hermes_gateway, "/detokenize", {"tokens": ids}).json()["prompt"]
    # `arguments | tojson` of the object; of the string it was, it would be "{\"city\": ...}".
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text, text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # The second turn: the same rendering reaches the replica.
    client = openai.OpenAI(base_url=f"{hermes_gateway}/v1", api_key=EDGE_API_KEY, max_retries=0, timeout=120)
    second = client.chat.completions.create(
        model="kvtier-tiny", messages=SECOND_TURN, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert second.usage.prompt_tokens == len(ids)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("calls", "param"),
    [
        ([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}],
         "messages.1.tool_calls.0.function.arguments"),
        (["not a call"], "messages.1.tool_calls.0"),
        ({"function": {}}, "messages.1.tool_calls"),
    ],
)  # fmt: skip
def test_tool_calls_a_template_cannot_read_are_400s_naming_them(hermes_gateway, calls, param):
    messages = [SECOND_TURN[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    for path in ("/tokenize", "/v1/chat/completions"):
        reply = _post(hermes_gateway, path, {"model": "kvtier-tiny", "messages": messages, "max_tokens": 2})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.text


@pytest.mark.slow
def test_tool_call_arguments_already_an_object_or_empty_render_as_objects(hermes_gateway):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": ""}},
    ]
    messages = [SECOND_TURN[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    ids = _post(hermes_gateway, "/tokenize", {"messages": messages}).json()["tokens"]
    text = _post(hermes_gateway, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert '"arguments": {"city": "Oslo"}}' in text and '{"name": "get_time", "arguments": {}}' in text
