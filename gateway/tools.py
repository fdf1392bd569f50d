"""Tools in chat completions: `tools` and `tool_choice` in, `tool_calls` out.

`plan_tools` reads a request's tools and tool choice into a `ToolPlan`:
- `none`: the model answers in text (the chat template still gets the tools, as vLLM does);
- `auto` (the default when tools are given): the model's text is parsed for tool calls by the
  parser `--tool-call-parser` names (`PARSERS`): Hermes-style `<tool_call>{json}</tool_call>` or
  Llama-3-style bare JSON `{"name": ..., "parameters": {...}}`; text outside calls is content;
- `required` and a named function: the output is constrained (a `Constraint`, enforced by the
  replica's grammar mask) to a JSON array of calls, each an `{"name", "parameters"}` object
  valid for one tool's schema (required), or to the named function's arguments (named).

`ToolOutput` turns one choice's text into content and calls, whole (`finish`) or as it streams
(`feed`, then `finish`): streamed calls are OpenAI's `tool_calls` deltas (the first of a call
carries its index, id, type and name; the arguments follow). A choice with calls ends with
finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvtier.gateway.errors import bad_request
from kvtier.gateway.protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage
from kvtier.gateway.streaming import ChatEvents, sse
from kvtier.structured_output import Constraint

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+'s marker before a tool call
DEFAULT_PARSER = "hermes"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def message(self) -> dict:
        """As in a non-streamed message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def deltas(self, index: int) -> list[dict]:
        """As streamed deltas, one `tool_calls` entry each: the call's head (id, type, name and
        arguments ""), then its arguments."""
        head = {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }
        return [
            {"tool_calls": [head]},
            {"tool_calls": [{"index": index, "function": {"arguments": self.arguments}}]},
        ]


def _call_of(obj: Any) -> ToolCall | None:
    """A call from a parsed `{"name": ..., "arguments" | "parameters": {...}}`; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_for_template(calls: Any, param: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them: each function's
    `arguments` an object parsed from its JSON text (Hermes, Qwen 2.5 and Llama 3.1 templates
    render `arguments | tojson`; vLLM and SGLang pass objects too), unset or "" as {}. A 400 naming
    `param` (the message's `tool_calls`) for calls that are not objects with a `function` object,
    or arguments that are not JSON."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list of tool calls", param=param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"{param}.{j} must be an object with a 'function' object", param=f"{param}.{j}")
        args = function.get("arguments")
        if isinstance(args, str) and args.strip():
            try:
                args = json.loads(args)
            except ValueError as e:
                where = f"{param}.{j}.function.arguments"
                raise bad_request(f"{where} is not valid JSON ({e})", param=where) from None
        elif not args:
            args = {}
        out.append(call | {"function": function | {"arguments": args}})
    return out


# --- parsers of model output (tool_choice auto) --------------------------------------------------


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5, ...);
    text outside them is content. A last block the model did not close still counts when its
    JSON is whole."""

    name = "hermes"
    at_start_only = False
    _BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        content = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            try:
                call = _call_of(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue  # not a call: the block stays in the content
            content.append(text[pos : m.start()])
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        return "".join(content), calls

    def held(self, text: str) -> int:
        """Where the streamed text must stop being sent as content: the start of an open tag or of
        what could still become one."""
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def complete(self, text: str) -> bool:
        """Whether everything held back is whole calls (each block closed)."""
        return text.count(HERMES_OPEN) == text.count(HERMES_CLOSE) and text.rstrip().endswith(HERMES_CLOSE)


class Llama3JsonParser:
    """Llama 3's JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (optionally
    after `<|python_tag|>`, several separated by `;`); anything else is content."""

    name = "llama3_json"
    at_start_only = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return "", calls

    def held(self, text: str) -> int:
        """A call starts the output: hold everything once it could be one (`{`, the python tag)."""
        body = text.lstrip()
        if not body or body.startswith("{") or PYTHON_TAG.startswith(body[: len(PYTHON_TAG)]):
            return 0
        return len(text)

    def complete(self, text: str) -> bool:
        return False  # a JSON call is known whole only at the end of the output


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser)}


# --- the request side ----------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its generation and its response."""

    tools: list[dict] | None  # for the chat template (None: no tools)
    mode: str = "none"  # "none", "auto", "required" or "named"
    function: str | None = None  # the named function
    constraint: Constraint | None = None  # the output grammar (required, named)
    parser: Any = None  # the output parser (auto)

    @property
    def active(self) -> bool:
        """Whether responses may carry tool calls."""
        return self.mode != "none"


def _check_tools(tools: Any) -> dict[str, dict]:
    """{name: parameters schema} of the request's function tools; 400 naming the bad entry."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {...}}", param="tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{i}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise bad_request(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                param=f"tools.{i}.function.name",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
        if name in out:
            raise bad_request(
                f"tools[{i}]: the function name {name!r} is given twice", param=f"tools.{i}.function.name"
            )
        out[name] = params
    return out


def plan_tools(tools: Any, tool_choice: Any, parser_name: str = DEFAULT_PARSER) -> ToolPlan:
    """The plan of a request's `tools` and `tool_choice` (OpenAI's defaults: auto with tools,
    none without); 400 naming the field when either is malformed."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions it may call", param="tool_choice")
        return ToolPlan(None)
    schemas = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        return ToolPlan(tools, "auto", parser=PARSERS[parser_name]())
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in schemas.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan(tools, "required", constraint=Constraint.json_schema(schema, "tool_choice"))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in schemas:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolPlan(tools, "named", name, Constraint.json_schema(schemas[name], "tool_choice"))


# --- the response side ---------------------------------------------------------------------------


class ToolOutput:
    """One choice's output under a plan: content and tool calls, whole or streamed."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of `text` sent as content or as a named call's arguments
        self.calls: list[ToolCall] = []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. An output a constrained plan could not finish
        (max_tokens) is returned as content with no calls."""
        mode = self.plan.mode
        if mode == "named":
            return None, [ToolCall(self.plan.function, text)]
        if mode == "required":
            try:
                calls = [_call_of(c) for c in json.loads(text)]
            except (ValueError, TypeError):
                return text, []
            return (None, calls) if calls and all(calls) else (text, [])
        if mode == "auto":
            content, calls = self.plan.parser.parse(text)
            return (content if content.strip() or not calls else None), calls
        return text, []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def whole(self, text: str, reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """A non-streamed choice: (content, tool_calls as in the message or None, finish_reason)."""
        content, self.calls = self.parse(text)
        return content, [c.message() for c in self.calls] or None, self.finish_reason(reason)

    def feed(self, delta: str) -> list[dict]:
        """The deltas to stream for `delta`, the next piece of the output: `{"content": ...}` and
        `{"tool_calls": [...]}` dicts, in order (what cannot be known yet is held back)."""
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            out = []
            if not self.calls:
                self.calls = [ToolCall(self.plan.function, "")]
                out.append(self.calls[0].deltas(0)[0])
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if mode == "required":
            return []  # a JSON array of calls: known at its end
        if mode == "auto":
            parser = self.plan.parser
            held = self.text[self.sent :]
            if parser.complete(held):
                self.sent = len(self.text)
                return self._parsed(held)
            # A bare-JSON call is only one that starts the output.
            upto = len(self.text) if self.sent and parser.at_start_only else self.sent + parser.held(held)
            if upto > self.sent:
                out = [{"content": self.text[self.sent : upto]}]
                self.sent = upto
                return out
            return []
        self.sent = len(self.text)
        return [{"content": delta}] if delta else []

    def finish(self) -> list[dict]:
        """The deltas still held back when the output ends."""
        if self.plan.mode == "named":
            return self.feed("") if not self.calls else []
        held = self.text[self.sent :]
        self.sent = len(self.text)
        if self.plan.mode == "required":
            content, calls = self.parse(held)
            self.calls = calls
            return [d for i, c in enumerate(calls) for d in c.deltas(i)] or (
                [{"content": content}] if content else []
            )
        return self._parsed(held) if held else []

    def _parsed(self, held: str) -> list[dict]:
        content, calls = self.plan.parser.parse(held) if self.plan.mode == "auto" else (held, [])
        out = [{"content": content}] if content else []
        for call in calls:
            out += call.deltas(len(self.calls))
            self.calls.append(call)
        return out


# --- streamed chat ---------------------------------------------------------------------------------


class ToolChatEvents(ChatEvents):
    """ChatEvents whose text goes through each choice's ToolOutput: content deltas, tool_calls
    deltas, and finish_reason "tool_calls" for a choice that called a tool."""

    def __init__(self, plan: ToolPlan, *args: Any):
        super().__init__(*args)
        self.outputs = {job.index: ToolOutput(plan) for job in self.streams.jobs}

    def chunk(self, job: Any, reply: Any) -> bytes:
        out = self.outputs[job.index]
        deltas = out.feed(reply.text)
        if reply.finish_reason:
            deltas += out.finish()
        events = [self._event(job.index, delta) for delta in deltas]
        if reply.finish_reason:
            events.append(self._event(job.index, {}, out.finish_reason(reply.finish_reason)))
        return b"".join(events)

    def _event(self, index: int, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(**delta), finish_reason=finish_reason)
        return sse(ChatCompletionChunk(choices=[choice], **self.head).json_bytes())
