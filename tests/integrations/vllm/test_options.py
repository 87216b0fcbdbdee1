"""wcache/integrations/vllm/options.py: the extra config, validated before anything loads (no vLLM needed)."""

from __future__ import annotations

import pytest

from wcache.integrations.vllm.options import DEFAULT_TRANSFORM, EXTRA_CONFIG_KEYS, parse_extra_config


def test_defaults_fill_every_key() -> None:
    opts = parse_extra_config(None)
    assert set(opts) == set(EXTRA_CONFIG_KEYS)
    assert opts == {
        "socket": None,
        "mode": "zero_copy",
        "fallback": True,
        "timeout": 60.0,
        "transform": DEFAULT_TRANSFORM,
        "plan_file": None,
        "deposit": True,
    }


def test_extra_config_is_validated() -> None:
    assert parse_extra_config({"mode": "copy", "fallback": False})["fallback"] is False
    assert parse_extra_config({"timeout": "5", "deposit": 0})["timeout"] == 5.0
    with pytest.raises(ValueError, match=r"unknown .* keys.*'sockets'"):
        parse_extra_config({"sockets": "/x"})
    with pytest.raises(ValueError, match="mode must be"):
        parse_extra_config({"mode": "mmap"})
