"""What a model loaded by the plugin carries: its zero_copy leases (they live exactly as long as the model: vLLM
drops the loader object right after ``load_model``) and the record of where its weights came from."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CHECKPOINT_WEIGHTS_ATTR", "INFO_ATTR", "WEIGHTS_ATTR", "cached_weights", "hold", "model_info"]

#: the attribute of the loaded module that holds its zero_copy weights (and so the daemon's lease)
WEIGHTS_ATTR = "_wcache_weights"
#: the attribute of the loaded module that says where its weights came from: {"origin": "cache" | "deposit" |
#: "disk", "mode", "key", "tensors", ...} or {"origin": "disk", "reason"} after a fallback
INFO_ATTR = "_wcache"
#: the attribute of a model that mapped a deposit and rebuilt some modules from the checkpoint key: that
#: key's zero_copy weights (its lease, for the model's life like WEIGHTS_ATTR's)
CHECKPOINT_WEIGHTS_ATTR = "_wcache_checkpoint_weights"


def hold(model: nn.Module, weights: Any, checkpoint: Any = None) -> None:
    """Tie the zero_copy leases to the model: ``weights`` (what its parameters view) and, for a model that
    mapped a deposit and rebuilt modules from the checkpoint key, ``checkpoint``."""
    model.__dict__[WEIGHTS_ATTR] = weights
    if checkpoint is not None:
        model.__dict__[CHECKPOINT_WEIGHTS_ATTR] = checkpoint


def cached_weights(model: nn.Module) -> Any:
    """The zero_copy :class:`~wcache.client.CachedWeights` a model loaded by this plugin holds (None for a
    copy-mode or fallback load)."""
    return model.__dict__.get(WEIGHTS_ATTR)


def model_info(model: nn.Module) -> dict[str, Any]:
    """Where a model's weights came from, as this plugin recorded it (``INFO_ATTR``), and whether it holds a
    zero_copy lease (``holds_weights``); ``{}`` for a model this plugin did not load. For
    ``LLM.apply_model(model_info)``, which runs it in every worker."""
    info = dict(model.__dict__.get(INFO_ATTR) or {})
    if info:
        info["holds_weights"] = cached_weights(model) is not None
    return info
