"""The loader's name in vLLM and its ``--model-loader-extra-config`` keys, validated before anything loads."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["DEFAULT_TRANSFORM", "EXTRA_CONFIG_KEYS", "LOAD_FORMAT", "Options", "parse_extra_config"]

#: ``--load-format wcache``
LOAD_FORMAT = "wcache"
EXTRA_CONFIG_KEYS = ("socket", "mode", "fallback", "timeout", "transform", "plan_file", "deposit")
#: the daemon's ``--transform`` that serves vLLM's parameter layout (the key names it, so both sides must agree)
DEFAULT_TRANSFORM = "wcache.transforms:vllm_layout"


class Options(TypedDict):
    """The extra config with its defaults filled in (docs/integrations.md, "vLLM")."""

    socket: str | None  #: the daemon's socket; None: wcache's default path for the rank
    mode: str  #: "zero_copy" (views of the daemon's memory, a lease for the model's life) or "copy"
    fallback: bool  #: a daemon that is absent, refuses or serves another key: vLLM's default loader
    timeout: float  #: seconds, per request to the daemon
    transform: str  #: the daemon's --transform
    plan_file: str | None  #: the daemon's --shard-plan
    deposit: bool  #: write back the post-processed state and map it on later starts


def parse_extra_config(extra: dict[str, Any] | None) -> Options:
    """``--model-loader-extra-config`` as :class:`Options`; ValueError for an unknown key or mode."""
    cfg = dict(extra or {})
    unknown = sorted(set(cfg) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown --model-loader-extra-config keys for {LOAD_FORMAT}: {unknown}")
    mode = cfg.get("mode", "zero_copy")
    if mode not in ("zero_copy", "copy"):
        raise ValueError(f"mode must be 'zero_copy' or 'copy', got {mode!r}")
    return {
        "socket": cfg.get("socket"),
        "mode": mode,
        "fallback": bool(cfg.get("fallback", True)),
        "timeout": float(cfg.get("timeout", 60.0)),
        "transform": str(cfg.get("transform", DEFAULT_TRANSFORM)),
        "plan_file": cfg.get("plan_file"),
        "deposit": bool(cfg.get("deposit", True)),
    }
