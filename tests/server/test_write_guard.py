"""zero_copy tensors are read-only: a write is a crash, the guard makes it a Python error (host backend)."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import DaemonProc
from wcache import WCacheClient, WeightCacheKey
from wcache.nn import ReadOnlyWeightError, attach, empty_parameters, guard_writes, load_from_disk

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"


class Head(nn.Module):
    """Two cached parameters; ``forward`` can be told to scale its weight in place (an engine's bug)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.write_in_forward = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.write_in_forward:
            self.norm.data.mul_(2)
        out: torch.Tensor = self.embed(ids) * self.norm
        return out


def _head(weights: Mapping[str, torch.Tensor]) -> tuple[Head, dict[str, torch.Tensor]]:
    """A Head on the meta device and the cached tensors under its parameter names."""
    w = {"embed.weight": weights[EMBED], "norm": weights[NORM]}
    with empty_parameters():
        m = Head(*w["embed.weight"].shape)
    return m, w


def test_write_into_zero_copy_tensor_is_a_sigsegv(daemon: DaemonProc, ckpt: Path) -> None:
    """What the README warns about: no Python error, the process dies (so the guard exists)."""
    code = textwrap.dedent(
        f"""
        from wcache import WCacheClient, WeightCacheKey
        w = WCacheClient({str(daemon.socket)!r}).fetch_sync(WeightCacheKey.from_checkpoint({str(ckpt)!r}))
        w[{NORM!r}].mul_(2)
        """
    )

    def no_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=120, check=False, preexec_fn=no_core
    )
    assert out.returncode == -signal.SIGSEGV, out.stderr.decode()


async def test_guard_turns_every_kind_of_write_into_an_error(daemon: DaemonProc, ckpt: Path) -> None:
    disk = load_from_disk(ckpt)
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        m, mine = _head(w)
        attach(m, mine)
        assert not any(p.requires_grad for p in m.parameters())
        norm = w[NORM]
        writes = {
            "in-place op": lambda: norm.mul_(2),
            "through .data": lambda: m.norm.data.copy_(torch.zeros_like(norm)),
            "item assignment": lambda: norm.__setitem__(0, 1.0),
            "a view's write": norm[:4].zero_,
            "out=": lambda: torch.add(norm, 1, out=norm),
            "nn.init": lambda: nn.init.normal_(m.embed.weight),
        }
        with guard_writes(w):
            assert torch.equal(norm * 2, disk[NORM] * 2)  # reads and out-of-place ops are untouched
            for what, write in writes.items():
                with torch.no_grad(), pytest.raises(ReadOnlyWeightError, match="mode='copy'"):
                    write()  # type: ignore[no-untyped-call]
                assert torch.equal(w[NORM], disk[NORM]), what
            with torch.inference_mode(), pytest.raises(ReadOnlyWeightError):
                norm.add_(1)
            # load_state_dict re-raises what copy_ raised as a RuntimeError naming each parameter
            with pytest.raises(RuntimeError, match=r"parameter named \"norm\".*mode='copy'"):
                m.load_state_dict({k: torch.zeros_like(v) for k, v in mine.items()})
            scratch = torch.ones(3)
            scratch.mul_(2)  # tensors the guard was not given stay writable
        assert torch.equal(w[EMBED], disk[EMBED]) and torch.equal(w[NORM], disk[NORM])
    st = await WCacheClient(daemon.socket).status()
    assert st.models and st.models[0].leases == 0  # the daemon served on and the lease ended


async def test_attach_guard_covers_forward_and_leaves_no_mode_behind(daemon: DaemonProc, ckpt: Path) -> None:
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        m, mine = _head(w)
        attach(m, mine, guard=True)
        ids = torch.tensor([[1, 2, 3]])
        expected = w[EMBED][ids] * w[NORM]
        with torch.inference_mode():
            assert torch.equal(m(ids), expected)
            m.write_in_forward = True
            with pytest.raises(ReadOnlyWeightError):
                m(ids)
        assert torch._C._len_torch_dispatch_stack() == 0  # the failed forward exited the mode
        assert torch.equal(w[NORM], load_from_disk(ckpt)[NORM])


async def test_copy_mode_weights_are_writable_and_private(daemon: DaemonProc, ckpt: Path) -> None:
    client = WCacheClient(daemon.socket)
    key = WeightCacheKey.from_checkpoint(ckpt)
    own = await client.fetch(key, mode="copy")
    own[NORM].mul_(2)
    async with await client.fetch(key) as shared:
        assert torch.equal(own[NORM], shared[NORM] * 2)
