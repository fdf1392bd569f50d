"""The one sampling schema (kvtier.sampling_schema): every layer reads it, one max_tokens rule, and
the gateway's imports stay free of the compute side."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from kvtier.api import compute_pb2
from kvtier.compute_client import ComputeClient
from kvtier.computesvc.sampling import SamplingParams
from kvtier.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.sampling_schema import BY_NAME, FIELDS, ContextLengthError, resolve_max_tokens


def test_every_row_is_an_optional_proto_field_and_a_sampling_param_with_its_default():
    proto = compute_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    params = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for spec in FIELDS:
        assert proto[spec.name].has_presence, spec.name  # `optional`: unset = the model's default
        assert params[spec.name] == spec.default, spec.name
    optional = {name for name, f in proto.items() if f.has_presence and f.message_type is None}
    assert optional == set(BY_NAME)


def test_the_gateway_request_has_a_field_per_row_with_an_openai_name():
    req = CompletionRequest(prompt="x", temperature=0.5, top_k=-1, min_p=0.1, seed=7)
    for spec in FIELDS:
        if spec.openai:
            assert (
                spec.openai in CompletionRequest.model_fields
                and spec.openai in ChatCompletionRequest.model_fields
            )
    # Only what the client set, with vLLM's top_k -1 (off) as the wire's 0.
    assert req.sampling() == {"temperature": 0.5, "top_k": 0, "min_p": 0.1, "seed": 7}


def test_the_compute_client_sets_only_what_is_given_and_refuses_unknown_fields():
    request = ComputeClient.request(prompt="x", temperature=0.0, top_p=None, max_tokens=3)
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert request.sampling.max_tokens == 3
    with pytest.raises(TypeError, match="unknown sampling fields \\['temprature'\\]"):
        ComputeClient.request(prompt="x", temprature=0.0)


@pytest.mark.parametrize(
    ("requested", "prompt", "model_default", "fallback", "want"),
    [
        (5, 10, None, 16, 5),  # asked for: as asked
        (None, 10, 64, 16, 64),  # the model's default first
        (None, 120, 64, 16, 8),  # ... which yields to the context
        (None, 128, 64, 16, 1),  # ... down to 1 (then the context check refuses)
        (None, 10, None, 16, 16),  # the endpoint's fallback
        (None, 10, None, None, 118),  # else the rest of the context
    ],
)
def test_max_tokens_rule(requested, prompt, model_default, fallback, want):
    if prompt + want > 128:
        with pytest.raises(ContextLengthError):
            resolve_max_tokens(requested, prompt, 128, model_default, fallback)
        return
    assert resolve_max_tokens(requested, prompt, 128, model_default, fallback) == want


def test_max_tokens_rule_names_the_prompt_when_it_alone_is_too_long():
    with pytest.raises(ContextLengthError, match="the prompt has 128: no room") as e:
        resolve_max_tokens(None, 128, 128, None, None)
    assert e.value.prompt_alone
    with pytest.raises(ContextLengthError, match=r"needs 130 \(120 prompt \+ 10 max_tokens\)") as e:
        resolve_max_tokens(10, 120, 128, None, None)
    assert not e.value.prompt_alone


def test_field_errors_name_the_field_its_range_and_the_value():
    assert BY_NAME["top_p"].error(0.0) == "top_p must be in (0, 1], got 0.0"
    assert BY_NAME["temperature"].error(float("inf")) == "temperature must be >= 0 (0 = greedy), got inf"
    assert BY_NAME["logprobs"].error(21, name="top_logprobs") == "top_logprobs must be in [0, 20], got 21"
    assert (
        BY_NAME["max_tokens"].error(0, {"max_model_len": 8})
        == "max_tokens must be in [1, 8] (max_model_len), got 0"
    )
    assert BY_NAME["seed"].error(1 << 70).startswith("seed must fit in 64 bits")
    assert BY_NAME["min_p"].error(0.5) is None


def test_the_gateway_imports_nothing_of_the_compute_side():
    code = (
        "import sys, gateway.app, gateway.__main__\n"
        "from gateway.model import load_served_model\n"
        "load_served_model(None, 'tiny')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('computesvc', 'kernels'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
