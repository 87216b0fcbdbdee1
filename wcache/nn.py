"""Engines use it: attach cached tensors to a torch module, and fall back to disk.

- ``empty_parameters()``: build a module with its parameters on the meta device (no memory,
  no init) while buffers computed at init (rotary ``inv_freq``...) stay real.
- ``attach(module, weights)``: make the cached tensors the module's parameters and buffers —
  no copy in zero_copy mode; tied parameters stay tied. A parameter the cache does not hold
  is an error listing every such name; a buffer computed at init is kept and listed in one
  log line. Parameters get ``requires_grad=False``.
- ``guard_writes(weights)`` / ``attach(..., guard=True)``: turn an in-place write into the
  cached tensors into a Python ``ReadOnlyWeightError`` instead of a crash (see below).
- ``load_weights(...)``: fetch from the daemon; when it is absent, refuses, or the key
  mismatches, load the same (sharded, cast) tensors from disk with one warning naming the
  reason — or raise with ``fallback=False``.

zero_copy tensors are read-only memory shared with the daemon and every other engine. On
the host backend the mapping is PROT_READ: a write (``p.copy_(x)``, ``p.mul_(2)``,
``load_state_dict`` into an attached module, ``nn.init.*``) kills the process with SIGSEGV,
no traceback. On CUDA with the default VMM export the mapping is read-only where the driver
allows: a write is an illegal memory access that poisons the CUDA context; with
``--cuda-export ipc`` the mapping is writable and a write silently corrupts the weights every
engine on that daemon sees. Engines that modify weights in place (quantize, fuse, fine-tune)
fetch with ``mode="copy"``.

The guard is a ``TorchDispatchMode``: while it is active every aten op passes through Python,
and an op whose schema marks an argument as written (``add_``, ``copy_``, ``index_put_``,
``out=``...) raises if that argument's storage is a guarded slab. It catches writes through
any tensor sharing the storage (``p.data``, views, slices, ``p[0] = ...``). It cannot catch
what does not go through the dispatcher: custom C++/CUDA/Triton kernels writing through
``data_ptr()``, ``t.numpy()`` or ctypes, compiled graphs (torch.compile, CUDA graph replay),
other threads (the mode is thread-local), and code outside the guarded block. It costs a
Python call per aten op — about 6 µs on the 2-core CPU machine (a 2-layer Llama decode step,
143 ops: 0.70 ms plain, 1.60 ms guarded) — so it is off by default.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wcache.errors import IncompatibleModelError, WCacheError
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.rank import plan_rank

if TYPE_CHECKING:
    from wcache.client import WCacheClient
    from wcache.plan.recipe import RecipeKey
    from wcache.proto import Deposited

__all__ = [
    "AttachReport",
    "LoadedWeights",
    "ReadOnlyWeightError",
    "WriteGuard",
    "attach",
    "deposit_module",
    "empty_parameters",
    "guard_writes",
    "load_from_disk",
    "load_weights",
]

log = logging.getLogger("wcache.nn")


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Parameters registered inside this block live on the meta device; buffers do not.

    A parameter keeps its class and attributes (engines subclass Parameter: vLLM's quantized layers make
    ``PackedvLLMParameter`` / ``GroupQuantScaleParameter``, whose properties their post-processing reads)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            p = self._parameters[name]
            assert p is not None
            meta = torch.Tensor._make_subclass(type(p), p.detach().to("meta"), p.requires_grad)
            meta.__dict__.update(vars(p))
            self._parameters[name] = meta

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


class ReadOnlyWeightError(RuntimeError):
    """An in-place op would write into cached (read-only, shared) weights; fetch with mode="copy"."""


def _storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}  # aten op -> (position, name) of the arguments it writes


def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    found = _WRITTEN.get(func)
    if found is None:
        if torch.Tag.inplace_view in func.tags:  # t_, squeeze_, set_, resize_: metadata, not data
            found = ()
        else:
            found = tuple(
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        _WRITTEN[func] = found
    return found


def _guarded_tensors(weights: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    from wcache.client import CachedWeights

    if isinstance(weights, CachedWeights):
        return [g.tensor for g in weights.groups()]  # the stacked views: every name's storage, no per-name view
    if isinstance(weights, Mapping):
        return weights.values()
    return weights


class WriteGuard(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that raises ReadOnlyWeightError on an aten op writing into a guarded storage.

    Use it as a context manager (``with guard_writes(weights): ...``); ``attach(..., guard=True)``
    enters it around the module's forward. See the module docstring for what it cannot catch.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = {_storage_ptr(t) for t in _guarded_tensors(weights)} - {0}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for pos, name in _written_arguments(func):
            t = args[pos] if pos < len(args) else kwargs.get(name)
            if isinstance(t, torch.Tensor) and not t.is_meta and _storage_ptr(t) in self.storages:
                raise ReadOnlyWeightError(
                    f"{func} would write into a cached tensor {tuple(t.shape)} {t.dtype}: zero_copy weights are "
                    "read-only memory shared with the wcache daemon (a write is a SIGSEGV on the host backend, an "
                    "illegal memory access on CUDA); fetch with mode='copy' to modify weights in place"
                )
        return func(*args, **kwargs)


def guard_writes(weights: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> WriteGuard:
    """``with guard_writes(weights): ...`` — in-place writes into ``weights`` raise ReadOnlyWeightError.

    ``weights``: a CachedWeights, a name -> tensor mapping, or tensors. Thread-local; every op
    inside the block pays a Python call (off the hot path unless you want it there).
    """
    return WriteGuard(weights)


class _ForwardGuard:
    """Forward pre/post hooks that keep one WriteGuard active during the outermost forward."""

    def __init__(self, guard: WriteGuard) -> None:
        self.guard = guard
        self.depth = 0

    def enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.guard.__enter__()  # type: ignore[no-untyped-call]

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.guard.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def attach(
    module: nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True, guard: bool = False
) -> AttachReport:
    """Make ``weights`` the module's parameters and persistent buffers (by state-dict name).

    Parameters are ``requires_grad=False``: zero_copy tensors are read-only memory, and a
    write into them is a crash (SIGSEGV on the host backend, an illegal memory access on
    CUDA), not a Python error. With ``guard``, the module's forward runs under a WriteGuard
    (see guard_writes: in-place writes into the cached tensors raise ReadOnlyWeightError;
    every op pays a Python call). Use ``mode="copy"`` for weights you modify.

    Raises IncompatibleModelError listing every parameter (or meta buffer) missing from ``weights``,
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
        raise IncompatibleModelError(
            " | ".join(problems), details={"missing": missing + missing_meta_buffers, "unused": unused}
        )
    report = AttachReport(unused=unused)
    used: list[torch.Tensor] = []
    wrapped: dict[int, nn.Parameter] = {}  # one Parameter per cached tensor: tied weights stay tied
    for name in params:
        t = weights[name]
        p = wrapped.get(id(t))
        if p is None:
            p = wrapped[id(t)] = nn.Parameter(t, requires_grad=False)
            used.append(t)
        owner, leaf = _owner(module, name)
        owner._parameters[leaf] = p
        report.parameters += 1
    devices = {t.device for t in weights.values()}
    device = devices.pop() if len(devices) == 1 else None
    for name in buffers:
        owner, leaf = _owner(module, name)
        if name in weights:
            owner._buffers[leaf] = weights[name]
            used.append(weights[name])
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
    if guard:
        hooks = _ForwardGuard(WriteGuard(used))
        module.register_forward_pre_hook(hooks.enter)
        module.register_forward_hook(hooks.exit, always_call=True)
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
    transform: str = "",
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The same tensors a daemon would serve (same plan, slices, cast, aliases, transform), read from disk.

    ``model_dir``: the checkpoint directory; the other keywords but ``device`` are RankSpec's fields (``plan_file``
    ``None`` or ``""``: no plan file)."""
    plan = Path(plan_file) if plan_file else None
    return _from_disk(RankSpec(Path(model_dir), tp_rank, tp_size, dtype, plan, transform), device)


def _from_disk(spec: RankSpec, device: str | torch.device) -> dict[str, torch.Tensor]:
    """``load_from_disk`` of a spec (``load_weights``'s fallback reads the spec its key was built from)."""
    from safetensors import safe_open

    from wcache.peer_files import refuse_stubs

    with plan_rank(spec) as rp:
        ckpt, layout = rp.checkpoint, rp.layout
        refuse_stubs(ckpt.path, ckpt.files)  # a directory filled from a peer holds headers, not weights
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
        if spec.transform:
            from wcache.transforms import load_transform, rank_config

            with torch.no_grad():
                out = load_transform(spec.transform)(out, rank_config(ckpt.config, spec.tp_rank, spec.tp_size))
    return out


async def load_weights(
    model_dir: str | os.PathLike[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: str | None = None,
    plan_file: str | os.PathLike[str] | None = None,
    transform: str = "",
    verify_content: bool = False,
    mode: str = "zero_copy",
    client: Any = None,
    fallback: bool = True,
    device: str | torch.device = "cpu",
) -> LoadedWeights:
    """Weights for one rank: from the daemon if it can serve them, else (``fallback``) from disk.

    ``model_dir``: the checkpoint directory; ``tp_rank`` ... ``verify_content`` are RankSpec's fields
    (``verify_content``: the daemon's ``--verify-content``). The key is built from the whole spec, so a daemon
    serving a transform serves an engine asking for it."""
    from wcache.client import WCacheClient

    plan = Path(plan_file) if plan_file else None
    spec = RankSpec(Path(model_dir), tp_rank, tp_size, dtype, plan, transform, verify_content)
    try:
        key = WeightCacheKey.from_spec(spec)
        c = client if client is not None else WCacheClient()
        cached = await c.fetch(key, mode=mode)
        return LoadedWeights(cached, "cache", handle=cached)
    except WCacheError as exc:
        if not fallback:
            raise
        reason = f"{type(exc).__name__}: {exc.message}"
    log.warning("wcache: loading %s from disk instead of the cache (%s)", spec.checkpoint, reason)
    tensors = _from_disk(spec, device)
    return LoadedWeights(tensors, "disk", reason)


async def deposit_module(
    module: nn.Module,
    key: RecipeKey,
    client: WCacheClient | None = None,
    *,
    buffers: bool = True,
    timeout: float | None = None,
) -> Deposited:
    """Write-back (docs/protocol.md §4.13): deposit ``module``'s post-processed state — every parameter and
    (with ``buffers``) every buffer, persistent or not, by its module path — under the recipe ``key``
    (``RecipeKey.of(checkpoint_key, engine=...)``). A tensor registered under several names (tied weights)
    is deposited once and its other names become aliases. A later start builds the module on meta
    (``empty_parameters()``), fetches ``key`` and ``attach``es the result.

    Raises ValueError naming tensors that cannot be deposited (on meta, or of a dtype the protocol does not
    carry) before anything is sent, and what ``WCacheClient.deposit`` raises."""
    from wcache.client import WCacheClient

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        tensors[name] = p
    if buffers:
        for name, b in module.named_buffers(remove_duplicate=False):
            if b is not None:
                tensors[name] = b
                kinds[name] = "buffer"
    meta = [n for n, t in tensors.items() if t.is_meta]
    if meta:
        raise ValueError(f"{len(meta)} tensor(s) are on the meta device (never loaded): " + ", ".join(meta[:20]))
    c = client if client is not None else WCacheClient()
    done = await c.deposit(key, tensors, kinds=kinds, timeout=timeout)
    log.info("deposited %s tensors=%d bytes=%d", key.short(), done.tensors, done.bytes)
    return done
