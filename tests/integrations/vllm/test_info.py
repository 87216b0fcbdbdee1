"""wcache/integrations/vllm/info.py: the leases and the load record a model carries."""

from __future__ import annotations

from torch import nn

from wcache.integrations.vllm.info import CHECKPOINT_WEIGHTS_ATTR, INFO_ATTR, cached_weights, hold, model_info


def test_a_model_holds_its_leases_and_says_where_its_weights_came_from() -> None:
    model, weights, checkpoint = nn.Linear(1, 1), object(), object()
    assert model_info(model) == {} and cached_weights(model) is None  # not loaded by the plugin
    model.__dict__[INFO_ATTR] = {"origin": "disk", "reason": "CacheUnavailableError: no daemon"}
    assert model_info(model) == {"origin": "disk", "reason": "CacheUnavailableError: no daemon", "holds_weights": False}
    hold(model, weights, checkpoint)
    assert cached_weights(model) is weights and model.__dict__[CHECKPOINT_WEIGHTS_ATTR] is checkpoint
    assert model_info(model)["holds_weights"] is True
    assert "holds_weights" not in model.__dict__[INFO_ATTR]  # a copy: the record itself is unchanged
    bare = nn.Linear(1, 1)
    hold(bare, weights)
    assert CHECKPOINT_WEIGHTS_ATTR not in bare.__dict__
