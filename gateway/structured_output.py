"""The request fields that constrain a completion's output, as one `kvtier.structured_output.Constraint`.

OpenAI's `response_format` (`json_object`; `json_schema` with `strict`; `text` = none), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields, on both endpoints. At most
one may be set; each bad one is a 400 naming its field. The replica compiles the constraint and
refuses one that does not compile (INVALID_ARGUMENT naming the same field).
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.gateway.errors import APIError, bad_request
from kvtier.structured_output import CHOICE, GRAMMAR, JSON_OBJECT, REGEX, Constraint

# vLLM's guided_* fields and structured_outputs' keys -> the constraint kind they set.
GUIDED = {"guided_json": "json", "guided_regex": REGEX, "guided_choice": CHOICE, "guided_grammar": GRAMMAR}
_STRUCTURED_KEYS = ("json", REGEX, CHOICE, GRAMMAR, JSON_OBJECT)
# structured_outputs keys that tune a backend's behaviour and do not change the language (accepted).
_STRUCTURED_TUNING = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


def _one(kind: str, value: Any, param: str) -> Constraint:
    """The constraint of one field's value (vLLM's kind names: "json" is a schema)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"{param}: the JSON schema is not valid JSON ({e})", param=param) from None
        if not isinstance(value, dict | bool):
            raise bad_request(f"{param}: a JSON schema is an object, got {type(value).__name__}", param=param)
        constraint = Constraint.json_schema(value, param)
    elif kind == CHOICE:
        if not isinstance(value, list):
            raise bad_request(f"{param}: give a list of strings, got {type(value).__name__}", param=param)
        constraint = Constraint(CHOICE, tuple(value), param)
    elif kind == JSON_OBJECT:
        constraint = Constraint(JSON_OBJECT, "", param)
    else:
        constraint = Constraint(kind, value if isinstance(value, str) else "", param)
        if not isinstance(value, str):
            raise bad_request(
                f"{param}: the {kind} must be a string, got {type(value).__name__}", param=param
            )
    if why := constraint.error():
        raise bad_request(why, param=param)
    return constraint


def _response_format(fmt: Any) -> Constraint | None:
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object with a 'type'", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _one(JSON_OBJECT, None, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format.json_schema must be an object with a 'schema' (and a 'name')",
                param="response_format.json_schema",
            )
        # strict or not, the schema is enforced: strict only promises what we always do.
        return _one("json", spec["schema"], "response_format.json_schema.schema")
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


def _structured_outputs(spec: Any) -> list[Constraint]:
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(
        k
        for k, v in spec.items()
        if v not in (None, False) and k not in _STRUCTURED_KEYS + _STRUCTURED_TUNING
    )
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(_STRUCTURED_KEYS)}",
            param=f"structured_outputs.{unknown[0]}",
            code="unsupported_parameter",
        )
    return [
        _one(key, spec[key], f"structured_outputs.{key}")
        for key in _STRUCTURED_KEYS
        if spec.get(key) not in (None, False)
    ]


def constraint_of(req: Any) -> Constraint | None:
    """The one output constraint a completion or chat request sets (None: none); 400 naming the
    field when one is malformed or when two are set."""
    found: list[Constraint] = []
    extra = req.model_extra or {}
    fmt = getattr(req, "response_format", None) or extra.get("response_format")
    if fmt is not None and (constraint := _response_format(fmt)) is not None:
        found.append(constraint)
    if extra.get("structured_outputs") is not None:
        found += _structured_outputs(extra["structured_outputs"])
    found += [_one(kind, extra[name], name) for name, kind in GUIDED.items() if extra.get(name) is not None]
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise bad_request(f"set at most one output constraint, got {names}", param=found[1].param)
    return found[0] if found else None


def with_param(error: APIError, constraint: Constraint | None) -> APIError:
    """`error` with `param` set to the constraint's field when the replica refused the constraint
    (its message starts with that field's name, as computesvc.structured_output words it)."""
    named = constraint is not None and error.info.message.startswith(f"{constraint.param}: ")
    if named and error.status == 400 and error.info.param is None:
        error.info.param = constraint.param
    return error
