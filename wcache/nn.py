"""Engines use it: attach cached tensors to a torch module, and fall back to disk.

- ``empty_parameters()``: build a module with its parameters on the meta device (no memory,
  no init) while buffers computed at init (rotary ``inv_freq``...) stay real.
- ``attach(module, weights)``: make the cached tensors the module's parameters and buffers —
  no copy in zero_copy mode; tied parameters stay tied. A parameter the cache does not hold
  is an error listing every such name; a buffer computed at init is kept and listed in one
  log line.
- ``load_weights(...)``: fetch from the daemon; when it is absent, refuses, or the key
  mismatches, load the same (sharded, cast) tensors from disk with one warning naming the
  reason — or raise with ``fallback=False``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wcache.errors import WCacheError
from wcache.key import WeightCacheKey
from wcache.rank import plan_rank

__all__ = ["AttachReport", "LoadedWeights", "attach", "empty_parameters", "load_from_disk", "load_weights"]

log = logging.getLogger("wcache.nn")


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Parameters registered inside this block live on the meta device; buffers do not."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            p = self._parameters[name]
            assert p is not None
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass
class AttachReport:
    parameters: int = 0
    buffers: int = 0
    kept_buffers: list[str] = field(default_factory=list)  # computed at init, not in the cache
    unused: list[str] = field(default_factory=list)  # cached tensors the module has no place for


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    m = module
    for part in path:
        m = getattr(m, part)
    return m, leaf


def attach(module: nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True) -> AttachReport:
    """Make ``weights`` the module's parameters and persistent buffers (by state-dict name).

    Raises WCacheError listing every parameter (or meta buffer) missing from ``weights``,
    and every shape/dtype mismatch, before changing anything. With ``strict``, cached
    tensors the module does not use are an error too.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    missing = [n for n in params if n not in weights]
    missing_meta_buffers = [n for n, b in buffers.items() if n not in weights and b.is_meta]
    bad = [
        f"{n}: cache {tuple(weights[n].shape)} {weights[n].dtype}, module {tuple(t.shape)} {t.dtype}"
        for n, t in [*params.items(), *buffers.items()]
        if n in weights and (weights[n].shape != t.shape or (t.is_floating_point() != weights[n].is_floating_point()))
    ]
    unused = sorted(set(weights) - set(params) - set(buffers))
    problems = []
    if missing or missing_meta_buffers:
        names = missing + missing_meta_buffers
        problems.append(f"{len(names)} tensor(s) the module needs are not in the cache: " + ", ".join(names[:20]))
    if bad:
        problems.append("shape/dtype mismatches: " + "; ".join(bad[:10]))
    if strict and unused:
        problems.append(f"{len(unused)} cached tensor(s) have no place in the module: " + ", ".join(unused[:20]))
    if problems:
        raise WCacheError(" | ".join(problems), details={"missing": missing + missing_meta_buffers, "unused": unused})
    report = AttachReport(unused=unused)
    wrapped: dict[int, nn.Parameter] = {}  # one Parameter per cached tensor: tied weights stay tied
    for name in params:
        t = weights[name]
        p = wrapped.get(id(t))
        if p is None:
            p = wrapped[id(t)] = nn.Parameter(t, requires_grad=False)
        owner, leaf = _owner(module, name)
        owner._parameters[leaf] = p
        report.parameters += 1
    devices = {t.device for t in weights.values()}
    device = devices.pop() if len(devices) == 1 else None
    for name in buffers:
        owner, leaf = _owner(module, name)
        if name in weights:
            owner._buffers[leaf] = weights[name]
            report.buffers += 1
        else:
            report.kept_buffers.append(name)
            buf = owner._buffers[leaf]
            if device is not None and buf is not None and buf.device != device:
                owner._buffers[leaf] = buf.to(device)  # e.g. rotary inv_freq built on the CPU at init
    if report.kept_buffers:
        log.info(
            "attach kept %d buffer(s) computed at init (on %s): %s",
            len(report.kept_buffers),
            device,
            ", ".join(report.kept_buffers),
        )
    return report


@dataclass
class LoadedWeights:
    """Weights from the cache (``source == "cache"``) or from disk (``"disk"``, with the reason)."""

    tensors: Mapping[str, torch.Tensor]
    source: str
    reason: str = ""
    handle: Any = None  # the CachedWeights, to release()

    async def release(self) -> None:
        if self.handle is not None:
            await self.handle.release()


def load_from_disk(
    model_dir: str | os.PathLike[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: str | None = None,
    plan_file: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    transform: str = "",
) -> dict[str, torch.Tensor]:
    """The same tensors a daemon would serve (same plan, slices, cast, aliases, transform), read from disk."""
    from safetensors import safe_open

    rp = plan_rank(model_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, plan_file=plan_file)
    ckpt, layout = rp.checkpoint, rp.layout
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[Any]] = {}
    for p in layout.placements:
        by_file.setdefault(p.source.file, []).append(p)
    for f, places in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for p in places:
                if p.shard is None:
                    t = fh.get_tensor(p.source.name)
                else:
                    sl = fh.get_slice(p.source.name)
                    index = tuple(
                        slice(p.shard.start, p.shard.start + p.shard.length) if d == p.shard.dim else slice(None)
                        for d in range(len(p.source.shape))
                    )
                    t = sl[index]
                out[p.source.name] = t.to(device=device, dtype=getattr(torch, p.dtype)).contiguous()
    for alias, target in layout.aliases.items():
        out[alias] = out[target]
    if transform:
        from wcache.transforms import load_transform

        with torch.no_grad():
            out = load_transform(transform)(out, ckpt.config)
    return out


async def load_weights(
    model_dir: str | os.PathLike[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: str | None = None,
    plan_file: str | os.PathLike[str] | None = None,
    mode: str = "zero_copy",
    client: Any = None,
    fallback: bool = True,
    device: str | torch.device = "cpu",
    transform: str = "",
) -> LoadedWeights:
    """Weights for one rank: from the daemon if it can serve them, else (``fallback``) from disk."""
    from wcache.client import WCacheClient

    try:
        key = WeightCacheKey.from_checkpoint(
            model_dir, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, plan_file=plan_file
        )
        c = client if client is not None else WCacheClient()
        cached = await c.fetch(key, mode=mode)
        return LoadedWeights(cached, "cache", handle=cached)
    except WCacheError as exc:
        if not fallback:
            raise
        reason = f"{type(exc).__name__}: {exc.message}"
    log.warning("wcache: loading %s from disk instead of the cache (%s)", model_dir, reason)
    tensors = load_from_disk(
        model_dir,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
        plan_file=plan_file,
        device=device,
        transform=transform,
    )
    return LoadedWeights(tensors, "disk", reason)
