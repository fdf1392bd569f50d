"""A model's own sampling defaults, from the `generation_config.json` of its directory.

Like vLLM's `--generation-config auto`: the fields the file sets are the defaults of every request
that leaves them unset (the gRPC SamplingParams fields are `optional`, and the gateway forwards an
unset field as unset). Only the keys present in the file count: Hugging Face's own class defaults
(top_k=50, ...) are not the model's choice and are not applied.

The keys read are the `hf` names of kvtier.sampling_schema's rows. This module reads JSON only
(no torch, no transformers): the gateway imports it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.sampling_schema import FIELDS

GENERATION_CONFIG = "generation_config.json"


def read_generation_defaults(model_dir: str | Path | None) -> dict[str, Any]:
    """{SamplingParams field: default} from `model_dir`/generation_config.json ({} without one).

    `do_sample: false` makes the default greedy (temperature 0), as Hugging Face's `generate`
    ignores temperature/top_p/top_k then. Raises ValueError naming the file when it is not JSON.
    """
    if model_dir is None:
        return {}
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    out: dict[str, Any] = {}
    for spec in FIELDS:
        value = raw.get(spec.hf) if spec.hf else None
        if value is not None:
            out[spec.name] = spec.kind(value)
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def describe(defaults: dict[str, Any]) -> str:
    """A log line's worth: `temperature=0.0 repetition_penalty=1.3` or `none`."""
    return " ".join(f"{k}={v}" for k, v in sorted(defaults.items())) or "none"
