"""The vLLM connector's settings (kvtier.vllm.config): vLLM's kv_connector_extra_config, then the
environment, then defaults; a bad value stops vLLM at startup with a line naming it. No vLLM needed."""

from __future__ import annotations

import re

import pytest

from kvtier.vllm.config import ConnectorConfig


def test_defaults_and_the_environment_below_the_extra_config(monkeypatch):
    monkeypatch.setenv("KVTIER_MAX_RESERVED_SHARE", "0.5")
    monkeypatch.setenv("KVTIER_SAVE_BATCH_MS", "0")
    cfg = ConnectorConfig.from_extra_config({"cache_address": "unix:///x.sock", "lookup_wait_ms": 7})
    assert (cfg.max_reserved_share, cfg.save_batch_ms, cfg.lookup_wait_ms) == (0.5, 0.0, 7.0)
    assert ConnectorConfig.from_extra_config({"max_reserved_share": "1"}).max_reserved_share == 1.0
    monkeypatch.delenv("KVTIER_MAX_RESERVED_SHARE")
    assert ConnectorConfig.from_extra_config({}).max_reserved_share == 0.25


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"max_reserved_share": 0}, "max_reserved_share must be > 0, got 0"),
        ({"max_reserved_share": 1.5}, "max_reserved_share must be at most 1, got 1.5"),
        ({"rpc_timeout_s": "soon"}, "rpc_timeout_s = 'soon' is not a number"),
        ({"block_index": "maybe"}, "block_index = 'maybe' is not true or false"),
        ({"cache_adress": "x"}, "unknown kv_connector_extra_config key(s) ['cache_adress']; known: ["),
        ({"max_staged_save_mib": 64}, "; max_staged_save_mib: saves are no longer staged in the engine: see max_reserved_share"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_it(extra, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ConnectorConfig.from_extra_config(extra)
