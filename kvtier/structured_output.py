"""Structured outputs as both sides carry them: what a request's output must match.

A `Constraint` is one grammar the whole output must match: a JSON Schema, any JSON object, a
regular expression, an EBNF grammar, or one of a list of strings. The gateway makes one from
the OpenAI and vLLM request fields (`response_format`, `structured_outputs`, `guided_*`, and
forced tool calls), the compute client puts it on the wire (`SamplingParams.structured_output`)
and the replica compiles and enforces it (computesvc.structured_output). `param` names the API
field it came from, so that a constraint that does not compile is refused naming that field.

This module checks only what needs no grammar library (kinds, types, sizes); the replica's
compiler is the judge of a grammar's meaning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvtier.api import compute_pb2

JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR, CHOICE = "json_schema", "json_object", "regex", "grammar", "choice"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR, CHOICE)
# The text of one constraint (a schema, a regex, a grammar, the choices together), in UTF-8
# bytes: room for a few dozen tool schemas while Generate stays within its byte limit (its
# 64 KiB allowance for sampling fields and strings, computesvc.__main__.generate_request_limit).
MAX_CONSTRAINT_BYTES = 32 * 1024
MAX_CHOICES = 256
DEFAULT_PARAM = "structured_output"


@dataclass(frozen=True)
class Constraint:
    """The output must match this. `value`: the JSON Schema's JSON text (json_schema), "" (any
    JSON object), the regex, the EBNF grammar (start rule `root`), or the choices (a tuple of
    strings). `param`: the API field it came from, named in errors."""

    kind: str
    value: str | tuple[str, ...] = ""
    param: str = DEFAULT_PARAM

    def error(self) -> str | None:
        """What is wrong with this constraint before any compiling (kind, type, size), naming
        `param` and the limit; None when nothing is."""
        if self.kind not in KINDS:
            return f"{self.param}: the constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
        if self.kind == CHOICE:
            if not isinstance(self.value, tuple) or not self.value:
                return f"{self.param}: give a non-empty list of choices"
            if len(self.value) > MAX_CHOICES:
                return f"{self.param}: {len(self.value)} choices, at most {MAX_CHOICES} allowed"
            if any(not isinstance(c, str) or not c for c in self.value):
                return f"{self.param}: every choice must be a non-empty string"
            size = sum(len(c.encode()) for c in self.value)
        elif self.kind == JSON_OBJECT:
            return None
        else:
            if not isinstance(self.value, str) or not self.value:
                return f"{self.param}: the {self.kind} must be a non-empty string"
            size = len(self.value.encode()) if len(self.value) <= MAX_CONSTRAINT_BYTES else len(self.value)
        if size > MAX_CONSTRAINT_BYTES:
            return f"{self.param}: the {self.kind} is {size} bytes, at most {MAX_CONSTRAINT_BYTES} allowed"
        if self.kind == JSON_SCHEMA:
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                return f"{self.param}: the JSON schema is not valid JSON ({e})"
            if not isinstance(schema, dict | bool):
                return (
                    f"{self.param}: a JSON schema is an object (or true/false), got {type(schema).__name__}"
                )
        return None

    def check(self) -> Constraint:
        """This constraint; ValueError with `error()` when it has one."""
        why = self.error()
        if why:
            raise ValueError(why)
        return self

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str) -> Constraint:
        """From a parsed JSON Schema (compact JSON text, keys in their given order)."""
        return cls(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)


def to_proto(constraint: Constraint) -> compute_pb2.StructuredOutput:
    msg = compute_pb2.StructuredOutput(param=constraint.param)
    if constraint.kind == JSON_OBJECT:
        msg.json_object = True
    elif constraint.kind == CHOICE:
        msg.choice.values.extend(constraint.value)
    else:
        setattr(msg, constraint.kind, constraint.value)
    return msg


def from_proto(msg: compute_pb2.StructuredOutput) -> Constraint | None:
    """The constraint of a SamplingParams.structured_output; None when it sets none."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    param = msg.param or DEFAULT_PARAM
    if kind == JSON_OBJECT:
        return Constraint(JSON_OBJECT, "", param)
    if kind == CHOICE:
        return Constraint(CHOICE, tuple(msg.choice.values), param)
    return Constraint(kind, getattr(msg, kind), param)
