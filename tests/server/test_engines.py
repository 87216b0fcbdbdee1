"""Engines use it: nn.Module attach, disk fallback, and Hugging Face transformers (CPU)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import DaemonProc
from wcache import CacheUnavailableError, KeyMismatchError, WCacheClient, WCacheError, WeightCacheKey
from wcache.nn import attach, empty_parameters, load_from_disk, load_weights


class TinyLM(nn.Module):
    """Parameters named like a Llama checkpoint's, for attach tests."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.register_buffer("scale", torch.full((hidden,), 2.0), persistent=False)


async def test_attach_zero_copy_tied(daemon_factory: Callable[..., DaemonProc], tied_ckpt: Path) -> None:
    d = daemon_factory(tied_ckpt)
    w = await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(tied_ckpt))
    cfg = json.loads((tied_ckpt / "config.json").read_text())
    with empty_parameters():
        m = TinyLM(cfg["vocab_size"], cfg["hidden_size"])
    assert m.lm_head.weight.is_meta and not m.scale.is_meta
    only = {k: v for k, v in w.items() if k.startswith(("model.embed_tokens", "model.norm", "lm_head"))}
    report = attach(m, only)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # type: ignore[union-attr]  # still tied
    emb = m.model.embed_tokens.weight  # type: ignore[union-attr]
    assert emb.data_ptr() == w["model.embed_tokens.weight"].data_ptr()  # no copy
    assert report.kept_buffers == ["scale"]
    await w.release()


class _TaggedParameter(nn.Parameter):
    """An engine's Parameter subclass with a property over an attribute (as vLLM's BasevLLMParameter)."""

    _output_dim: int

    @property
    def output_dim(self) -> int:
        return int(self._output_dim)


class _Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        p = _TaggedParameter(torch.zeros(4, 2), requires_grad=False)
        p._output_dim = 1
        self.register_parameter("w", p)


def test_empty_parameters_keeps_the_parameter_class_and_attributes() -> None:
    with empty_parameters():
        m = _Tagged()
    assert m.w.is_meta and type(m.w) is _TaggedParameter
    assert m.w.output_dim == 1 and m.w.shape == (4, 2) and not m.w.requires_grad


def test_attach_lists_missing_and_unused(tied_ckpt: Path) -> None:
    weights = load_from_disk(tied_ckpt)
    with empty_parameters():
        m = TinyLM(512, 64)
    with pytest.raises(WCacheError, match=r"not in the cache: model\.norm\.weight"):
        attach(m, {k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(WCacheError, match="no place in the module"):
        attach(m, weights)


async def test_fallback_to_disk_same_tensors(
    daemon: DaemonProc, ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cached = await load_weights(ckpt, tp_rank=1, tp_size=2, client=WCacheClient(tmp_path / "none.sock"))
    assert cached.source == "disk" and "CacheUnavailableError" in cached.reason
    served = await load_weights(ckpt, client=WCacheClient(daemon.socket))
    assert served.source == "cache"
    disk = load_from_disk(ckpt)
    assert all(torch.equal(served.tensors[k], disk[k]) for k in disk)
    await served.release()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wcache.nn"):
        mism = await load_weights(ckpt, dtype="float32", client=WCacheClient(daemon.socket))
    assert mism.source == "disk" and "KeyMismatchError" in mism.reason
    # the warning is the feature: a fallback tells the operator once (the state is asserted above)
    assert sum("from disk instead of the cache" in r.message for r in caplog.records) == 1
    assert mism.tensors["model.norm.weight"].dtype == torch.float32
    with pytest.raises(KeyMismatchError):
        await load_weights(ckpt, dtype="float32", client=WCacheClient(daemon.socket), fallback=False)
    with pytest.raises(CacheUnavailableError):
        await load_weights(ckpt, client=WCacheClient(tmp_path / "none.sock"), fallback=False)


transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)  # type: ignore[arg-type]
    return path


async def test_transformers_identical_to_from_pretrained(
    daemon_factory: Callable[..., DaemonProc], hf_model: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from wcache.integrations.transformers import from_pretrained

    d = daemon_factory(hf_model)
    model, weights = await from_pretrained(hf_model, client=WCacheClient(d.socket))
    assert weights is not None and weights.source == "cache"
    ref = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.bfloat16)
    ref.eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert torch.equal(a, b)
    ga = model.generate(ids, max_new_tokens=8, do_sample=False)
    gb = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)
    assert (
        model.model.layers[0].mlp.up_proj.weight.data_ptr()
        == weights.tensors["model.layers.0.mlp.up_proj.weight"].data_ptr()
    )
    await weights.release()


async def test_transformers_fallback(hf_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from wcache.integrations.transformers import from_pretrained

    with caplog.at_level(logging.WARNING, logger="wcache.transformers"):
        model, weights = await from_pretrained(hf_model, client=WCacheClient(tmp_path / "none.sock"))
    assert weights is None and model is not None
    assert any("CacheUnavailableError" in r.message for r in caplog.records)  # the fallback's warning is the feature
    with pytest.raises(CacheUnavailableError):
        await from_pretrained(hf_model, client=WCacheClient(tmp_path / "none.sock"), fallback=False)


FUSE = "wcache.transforms:fuse_llama_qkv_gate_up"


async def test_transform_fuses_per_rank_and_is_part_of_the_key(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    for r in (0, 1):
        daemon_factory(ckpt, "--tp-size", "2", "--tp-rank", str(r), "--transform", FUSE)
    client = WCacheClient(socket_dir=socket_dir)
    for r in (0, 1):
        key = WeightCacheKey.from_checkpoint(ckpt, tp_rank=r, tp_size=2, transform=FUSE)
        plain = load_from_disk(ckpt, tp_rank=r, tp_size=2)
        async with await client.fetch(key) as w:
            p = "model.layers.2."
            assert p + "self_attn.q_proj.weight" not in w
            qkv = torch.cat([plain[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0)
            assert torch.equal(w[p + "self_attn.qkv_proj.weight"], qkv)
            gate_up = torch.cat([plain[p + "mlp.gate_proj.weight"], plain[p + "mlp.up_proj.weight"]], dim=0)
            assert torch.equal(w[p + "mlp.gate_up_proj.weight"], gate_up)
            assert torch.equal(w[p + "mlp.down_proj.weight"], plain[p + "mlp.down_proj.weight"])
            disk = load_from_disk(ckpt, tp_rank=r, tp_size=2, transform=FUSE)  # the fallback gives the same
            assert set(disk) == set(w) and all(torch.equal(disk[k], w[k]) for k in disk)
        with pytest.raises(KeyMismatchError) as info:
            await client.fetch(WeightCacheKey.from_checkpoint(ckpt, tp_rank=r, tp_size=2))
        assert set(info.value.fields) == {"transform"}


def test_bad_transform_spec_is_a_clear_error(ckpt: Path, socket_dir: Path) -> None:
    import subprocess

    from tests.conftest import server_cmd

    for spec, msg in (("nope", "package.module:function"), ("wcache.transforms:missing", "cannot import")):
        out = subprocess.run(
            server_cmd("--model", str(ckpt), "--socket-dir", str(socket_dir), "--transform", spec),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 1
        assert msg in out.stderr


@pytest.fixture(scope="module")
def hf_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertModel saved like sentence-transformers' all-MiniLM-L6-v2: float32, architectures
    ["BertModel"], and an int64 ``embeddings.position_ids`` among the tensors (sorted before the weights)."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-bert"
    BertModel(cfg).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors = {"embeddings.position_ids": torch.arange(64).unsqueeze(0), **tensors}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


async def test_transformers_builds_the_checkpoints_own_class_in_the_configs_dtype(
    daemon_factory: Callable[..., DaemonProc], hf_bert: Path, hf_model: Path
) -> None:
    """A non-causal-LM checkpoint is served from the cache (it used to raise a plain ValueError)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, BertModel

    from wcache.integrations.transformers import auto_class_for, from_pretrained

    assert auto_class_for(AutoConfig.from_pretrained(hf_bert)) is AutoModel
    assert auto_class_for(AutoConfig.from_pretrained(hf_model)) is AutoModelForCausalLM
    masked = AutoConfig.from_pretrained(hf_bert, architectures=["BertForMaskedLM"])
    assert auto_class_for(masked) is AutoModelForMaskedLM
    d = daemon_factory(hf_bert)
    model, weights = await from_pretrained(hf_bert, client=WCacheClient(d.socket))
    assert isinstance(model, BertModel) and weights is not None and weights.source == "cache"
    assert model.dtype == torch.float32
    emb = model.embeddings.word_embeddings.weight
    assert emb.data_ptr() == weights.tensors["embeddings.word_embeddings.weight"].data_ptr()
    ref = AutoModel.from_pretrained(hf_bert).eval()
    ids = torch.tensor([[2, 7, 11, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, ref(ids).last_hidden_state)
    await weights.release()


class _RefusesToBuild:
    """An auto_class whose from_config fails the way transformers does (a plain ValueError)."""

    __name__ = "_RefusesToBuild"

    @classmethod
    def from_config(cls, config: object, **kwargs: object) -> object:
        raise ValueError("cannot be instantiated under this dtype")

    @classmethod
    def from_pretrained(cls, model_dir: object, **kwargs: object) -> str:
        return f"from disk: {model_dir}"


async def test_transformers_build_failure_falls_back_once_and_ends_the_lease(
    daemon_factory: Callable[..., DaemonProc], hf_bert: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from wcache.integrations.transformers import from_pretrained

    d = daemon_factory(hf_bert)
    client = WCacheClient(d.socket)
    with caplog.at_level(logging.WARNING, logger="wcache.transformers"):
        model, weights = await from_pretrained(hf_bert, client=client, auto_class=_RefusesToBuild)
    assert model == f"from disk: {hf_bert}" and weights is None
    # the warning is the feature: one per fallback
    assert [r.levelno for r in caplog.records if r.name == "wcache.transformers"] == [logging.WARNING]
    assert (await client.status()).models[0].leases == 0  # the fetched lease did not outlive the failure
    with pytest.raises(WCacheError, match="cannot build _RefusesToBuild") as info:
        await from_pretrained(hf_bert, client=client, auto_class=_RefusesToBuild, fallback=False)
    assert isinstance(info.value.__cause__, ValueError)
    assert (await client.status()).models[0].leases == 0


async def test_transformers_unknown_architecture_names_auto_class(hf_bert: Path, tmp_path: Path) -> None:
    import shutil

    from wcache.integrations.transformers import from_pretrained

    custom = tmp_path / "custom"
    shutil.copytree(hf_bert, custom)
    cfg = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**cfg, "architectures": ["MyBertEncoder"]}))
    with pytest.raises(ValueError, match="auto_class="):
        await from_pretrained(custom, client=WCacheClient(tmp_path / "none.sock"))
