"""``wcache``: operator commands against running daemons.

    wcache status [--socket-path P | --socket-dir D] [--json]
    wcache preload DIR [--tp-rank N --tp-size M --dtype D --transform MOD:FN] [--socket-path P | --socket-dir D]
    wcache evict DIR [--tp-rank N --tp-size M --dtype D --transform MOD:FN] [--fingerprint HEX]
                     [--deposit [ENGINE] [--recipe FIELD=VALUE ...] | --no-deposit] [--stale | --all]
                     [same socket options]
    wcache make-checkpoint DIR [--size SIZE]

``status`` prints one row per model of each daemon socket found (checkpoint directory, fingerprint, rank and
dtype, origin: disk / tier / keeper / takeover / deposit, size, tier, device, leases, last use, connections,
uptime) and, for a daemon on a GPU or with --host-tier, a line of its free device memory and host-tier use, or
the STATUS_REPLY frames as JSON (each model with ``stale`` added); exit 0 only if every socket found answered
(1: none found, or one of them is unreachable — a stale socket of a crashed daemon counts; its row says why, and
whether a daemon is coming back to it). Nothing is waited for. A model is *stale* when its checkpoint directory
no longer gives its key (the files changed, or are gone, since it was loaded): its fingerprint is marked
``(stale)``.
``preload`` asks the daemon of that rank to load and keep a checkpoint (evicting unleased models, least
recently used first, under its --memory-budget); ``evict`` drops it — without --tp-rank and --tp-size (or with
any of --fingerprint, --stale, --deposit, --recipe, --no-deposit), whatever the daemons serve of that checkpoint,
its deposits (engines' write-back, ``DIR [ENGINE deposit]``) included: one model is evicted; several are listed
with the options that pick each, and nothing is evicted; --all evicts every one, --stale every stale one.
--deposit [ENGINE] keeps only deposits (of that engine), --no-deposit only the checkpoint's own models.
``make-checkpoint`` writes a small random Llama-shaped checkpoint to try the daemon on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import stat
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from wcache import __version__
from wcache.client import WCacheClient
from wcache.command import CommandParser, plain_text
from wcache.errors import CacheUnavailableError, CheckpointError, NotFoundError, WCacheError
from wcache.paths import DEFAULT_SOCKET_DIR_HELP, default_socket_dir
from wcache.plan.key import WeightCacheKey, tp_problem
from wcache.plan.recipe import key_from_wire
from wcache.proto import ModelInfo, StatusReply
from wcache.units import format_size, size_arg

__all__ = ["build_parser", "main", "make_checkpoint_main", "parse_args"]


def _sockets(args: argparse.Namespace) -> list[Path]:
    if args.socket_path:
        return [args.socket_path]
    d = args.socket_dir or default_socket_dir()
    return sorted(Path(d).glob("*.sock"))


async def _status(paths: list[Path], timeout: float) -> list[tuple[Path, StatusReply | str]]:
    """Each socket's STATUS_REPLY, or why there is none. Nothing is waited for: a socket nobody listens on is
    reported at once, with whether a daemon is coming back to it (its lock held, or the keeper holding a model
    for it: wcache/client/wait.py) or not (a stale socket)."""
    from wcache.client import wait
    from wcache.paths import KEEPER_SOCKET

    async def one(p: Path) -> tuple[Path, StatusReply | str]:
        try:
            return p, await WCacheClient(p, timeout=timeout, wait_for_daemon=0).status()
        except WCacheError as exc:
            why = f"{type(exc).__name__}: {exc.message}"
            if isinstance(exc, CacheUnavailableError) and wait.is_absent(exc):
                coming = await wait.daemon_coming(p, p.parent / KEEPER_SOCKET, None)
                why += f"; a daemon is coming back ({coming})" if coming else f"; {_nobody_at(p)}"
            return p, why

    return list(await asyncio.gather(*(one(p) for p in paths)))


def _nobody_at(p: Path) -> str:
    """Why nobody answers at ``p`` when no daemon is coming back to it: what is there, and what to do."""
    try:
        mode = p.lstat().st_mode
    except OSError:  # nothing there, or its directory cannot be searched
        return "there is no socket at that path (start its daemon, or check the path)"
    if not stat.S_ISSOCK(mode):
        return "that path is not a socket (check the path)"
    return "nothing is coming back to it (a stale socket: start its daemon, or remove the file)"


def _no_sockets(socket_dir: Path | None) -> str:
    """Why ``wcache status`` (or ``evict``) found no socket in ``socket_dir`` (None: the default directory): it is
    not there, not a directory, not readable, or holds none."""
    d = Path(socket_dir or default_socket_dir())
    try:
        os.listdir(d)
    except FileNotFoundError:
        default = "" if socket_dir else " (the default: no daemon runs there; pass the daemons' --socket-dir)"
        return f"socket directory {d} does not exist{default}"
    except NotADirectoryError:
        return f"socket directory {d} is not a directory"
    except OSError as exc:
        return f"socket directory {d} cannot be read ({exc.strerror})"
    return f"no daemon sockets in {d}"


HEADER = [
    "SOCKET",
    "CHECKPOINT",
    "FINGERPRINT",
    "RANK",
    "ORIGIN",
    "SIZE",
    "TIER",
    "DEVICE",
    "LOADED",
    "LEASES",
    "LAST USE",
    "CONNS",
    "UPTIME",
]


def _loaded(nbytes: int, seconds: float) -> str:
    """How long the bytes took to arrive (a load, a tier refill, a fill from peers) and at what rate."""
    if seconds <= 0:
        return "-"
    return f"{seconds:.2f} s ({nbytes / seconds / 1e9:.2f} GB/s)"


def checkpoint_of(m: ModelInfo) -> str:
    """A served model's checkpoint as an operator knows it: its directory (the model's ``architecture@fingerprint``
    where the daemon does not know it); a deposit (write-back) names its engine too."""
    return checkpoint_named(m.key, m.source)


def checkpoint_named(key: dict[str, Any], source: str) -> str:
    """``checkpoint_of`` a key map and the directory it was loaded from ("" unknown)."""
    name = source or f"{key.get('architecture', '')}@{str(key.get('fingerprint', ''))[:12]}"
    if "engine" in key:
        quant = f" {key['quantization']}" if key.get("quantization") else ""
        name += f" [{key['engine']}{quant} deposit]"
    return name


#: The directory's fingerprint (of a kind) as its files give it now, or None where they give no key: the
#: cache of one command, keyed by (absolute directory, fingerprint kind)
FingerprintCache = dict[tuple[str, str], str | None]


def fingerprint_now(directory: str, kind: str, cache: FingerprintCache) -> str | None:
    """The fingerprint of ``kind`` ("sampled": headers and 64 KiB per file; "content": every byte) that the checkpoint
    ``directory`` gives now; None if it gives no key (gone, unreadable, or no longer a checkpoint). Read once per
    directory and kind."""
    where = (os.path.abspath(directory), kind)
    if where not in cache:
        from wcache.plan.checkpoint import Checkpoint

        try:
            with Checkpoint.open(where[0], tensors=False) as ckpt:
                cache[where] = ckpt.fingerprint(content=kind == "content")
        except (WCacheError, OSError):
            cache[where] = None
    return cache[where]


def stale_of(key: dict[str, Any], directory: str, cache: FingerprintCache, *, content: bool = True) -> bool | None:
    """Whether the checkpoint ``directory`` no longer gives the model of ``key`` (its files changed or are gone since
    the model was loaded from them); None where it cannot be told cheaply (``content`` False: a key of the "content"
    fingerprint kind, which would read every byte of the checkpoint)."""
    kind = str(key.get("fingerprint_kind", "sampled"))
    if kind == "content" and not content:
        return None
    return fingerprint_now(directory, kind, cache) != key.get("fingerprint")


def fingerprint_of(key: dict[str, Any], stale: bool | None = False) -> str:
    """A key's fingerprint as an operator tells models apart by it: its first 12 hex digits, ``(stale)`` if the
    directory no longer gives it."""
    return str(key.get("fingerprint", ""))[:12] + (" (stale)" if stale else "")


def rank_of(key: dict[str, Any]) -> str:
    """``tp0/2 bfloat16`` (and the load-time transform, if any) of a key map."""
    t = f" {key['transform']}" if key.get("transform") else ""
    return f"tp{key.get('tp_rank', '?')}/{key.get('tp_size', '?')} {key.get('dtype', '')}{t}"


def _stale(r: StatusReply, cache: FingerprintCache) -> list[bool | None]:
    """Each model's staleness against the directory it was loaded from (None where that is unknown: no directory,
    or a "content" fingerprint, which status does not read a whole checkpoint to check)."""
    return [stale_of(m.key, m.source, cache, content=False) if m.source else None for m in r.models]


def _rows(path: Path, r: StatusReply | str, now: float, stale: list[bool | None]) -> list[list[str]]:
    if isinstance(r, str):
        return [[str(path), *["-"] * (len(HEADER) - 2), r]]
    rows = []
    keeper = r.software.startswith("wcache-keeper/")  # holds daemons' slabs across their restarts
    tier = "keeper" if keeper else "device" if r.backend == "cuda" else "host"
    for m, is_stale in zip(r.models or (None,), stale or [None]):
        if m is None:
            device = f"{r.backend}:{r.device.uuid or r.device.kind}"
        elif keeper:
            owner = Path(m.owner) if m.owner else None
            who = "" if owner is None else f", for {owner.name if owner.parent == path.parent else owner}"
            device = f"{m.backend} (kept{who})"
        else:
            device = f"{r.backend}:{r.device.uuid or r.device.kind}"
        rows.append(
            [
                str(path),
                checkpoint_of(m) if m else "(none)",
                fingerprint_of(m.key, is_stale) if m else "-",
                rank_of(m.key) if m else "-",
                (m.origin or "?") if m else "-",
                format_size(m.bytes) if m else "-",
                tier if m else "-",
                device,
                _loaded(m.bytes, m.load_seconds) if m else "-",
                str(m.leases if m else 0),
                f"{now - m.last_use:.0f}s ago" if m and m.last_use else "never",
                str(r.connections),
                f"up {r.uptime_seconds:.0f}s",
            ]
        )
    return rows


def _summary(path: Path, r: StatusReply) -> str:
    parts = []
    if r.device_total_bytes:
        parts.append(f"device memory {r.device_free_bytes / 1e9:.1f} of {r.device_total_bytes / 1e9:.1f} GB free")
    if r.tier_budget:
        n = r.tier_entries
        parts.append(
            f"host tier {r.tier_bytes / 1e9:.2f} of {r.tier_budget / 1e9:.2f} GB in {n} entr{'y' if n == 1 else 'ies'}"
        )
    return f"{path}: " + "; ".join(parts) if parts else ""


def _to_json(r: StatusReply, stale: list[bool | None]) -> dict[str, Any]:
    """The STATUS_REPLY frame, each model with ``stale`` added: true / false, null where unknown (``_stale``)."""
    out = r.to_wire()
    out["models"] = [{**m, "stale": s} for m, s in zip(out["models"], stale)]
    return out


@dataclass(frozen=True, slots=True)
class Served:
    """A model of the checkpoint ``wcache evict`` names, as a daemon serves it."""

    socket: Path
    model: ModelInfo
    #: whether the checkpoint directory no longer gives its key (None: not read, a "content" fingerprint)
    stale: bool | None

    def describe(self) -> str:
        """``DIR tp0/1 bfloat16, fingerprint 851c82407fee (stale)``: the model as status shows it."""
        return f"{checkpoint_of(self.model)} {rank_of(self.model.key)}, fingerprint {self.fingerprint()}"

    def fingerprint(self) -> str:
        return fingerprint_of(self.model.key, self.stale)


def _served_of(
    args: argparse.Namespace, results: list[tuple[Path, StatusReply | str]]
) -> tuple[list[Served], str | None]:
    """The models of ``args.model`` the daemons serve, deposits included — the same directory, or the same
    sampled fingerprint — that agree with every option given (an option left out matches anything), and the
    sampled fingerprint the directory gives now (None: it gives no key, gone or no longer a checkpoint; then its
    models are those loaded from that directory, every one stale). Each model's staleness is told against the
    directory: with --stale (which keeps only stale ones) even for a "content" fingerprint, which reads every byte."""
    where = os.path.abspath(args.model)
    try:  # headers only: its fingerprint and stored dtype
        base: WeightCacheKey | None = WeightCacheKey.from_checkpoint(args.model).resolve()
    except (WCacheError, OSError):
        base = None
    cache: FingerprintCache = {(where, "sampled"): base.fingerprint if base is not None else None}
    want: dict[str, Any] = {"tp_rank": args.tp_rank, "tp_size": args.tp_size, "transform": args.transform}
    want["dtype"] = (base.dtype if base is not None else None) if args.dtype == "auto" else args.dtype
    prefix = (args.fingerprint or "").lower()
    recipe = dict(r.split("=", 1) for r in args.recipe or ())
    out = []
    for p, r in results:
        if not isinstance(r, StatusReply) or r.software.startswith("wcache-keeper/"):
            continue  # a keeper only holds what daemons serve: evict through the daemon
        for m in r.models:
            k = m.key
            same = (m.source and os.path.abspath(m.source) == where) or (
                base is not None
                and k.get("fingerprint") == base.fingerprint
                and k.get("fingerprint_kind", "sampled") == "sampled"
            )
            if not same or not str(k.get("fingerprint", "")).startswith(prefix):
                continue
            if "engine" in k:  # a deposit
                if args.no_deposit or (args.deposit and k["engine"] != args.deposit):
                    continue
                if any(str(k.get(f, "")) != v for f, v in recipe.items()):
                    continue
            elif args.deposit is not None or recipe:
                continue
            if not all(v is None or k.get(f, "") == v for f, v in want.items()):
                continue
            stale = stale_of(k, where, cache, content=args.stale)
            if stale or not args.stale:
                out.append(Served(p, m, stale))
    return out, cache[(where, "sampled")]


def _options(s: Served, found: list[Served], now: str | None) -> str:
    """The options that pick ``s`` among ``found``: its rank, dtype and transform; its fingerprint where the found
    models have several or ``s``'s is not what the directory gives now (``now``: the options alone would name the
    directory's current key); where deposits are found, --no-deposit for a checkpoint's own model, and for a deposit
    --deposit ENGINE and --recipe FIELD=VALUE for each recipe field another found deposit of its engine differs in."""
    k = s.model.key
    t = f" --transform {shlex.quote(str(k['transform']))}" if k.get("transform") else ""
    opts = f"--tp-rank {k.get('tp_rank')} --tp-size {k.get('tp_size')} --dtype {k.get('dtype')}{t}"
    if len({f.model.key.get("fingerprint") for f in found}) > 1 or k.get("fingerprint") != now:
        opts += f" --fingerprint {str(k.get('fingerprint', ''))[:12]}"
    if "engine" in k:
        opts += f" --deposit {shlex.quote(str(k['engine']))}"
        recipes = [_recipe(f.model.key) for f in found if f.model.key.get("engine") == k["engine"]]
        differ = sorted({name for r in recipes for name in r if any(o.get(name) != r.get(name) for o in recipes)})
        mine = _recipe(k)
        opts += "".join(" --recipe " + shlex.quote(f"{name}={mine.get(name, '')}") for name in differ)
    elif any("engine" in f.model.key for f in found):
        opts += " --no-deposit"
    return opts


def _recipe(key: dict[str, Any]) -> dict[str, str]:
    """A deposit's recipe fields (every key field a checkpoint's key lacks), as strings."""
    return {name: str(value) for name, value in key.items() if name not in _KEY_FIELDS}


#: A checkpoint's key fields: a deposit's others are its recipe (wcache.plan.recipe)
_KEY_FIELDS = frozenset(f.name for f in fields(WeightCacheKey))


async def _evict(args: argparse.Namespace) -> int:
    """``wcache evict DIR``: with --tp-rank and --tp-size (and no option that picks among DIR's models), the key they
    name, the checkpoint's own (its daemon says how it differs from what it serves); otherwise what the daemons
    serve of DIR, its deposits included, found through STATUS: one model (or, with --all, every one; with --stale,
    every stale one) is evicted, several are listed with the options that pick each."""
    picks = args.fingerprint or args.stale or args.deposit is not None or args.recipe or args.no_deposit
    if args.tp_rank is not None and args.tp_size is not None and not picks:
        from wcache.server.startup import rank_spec

        key = WeightCacheKey.from_spec(rank_spec(args))
        client = WCacheClient(args.socket_path, socket_dir=args.socket_dir, wait_for_daemon=0)
        ev = await client.evict(key, timeout=args.timeout)
        where = client.socket_for(key)
        print(f"evicted {args.model} {rank_of(key.to_wire())} from {where}: {format_size(ev.bytes)} freed")
        return 0
    paths = _sockets(args)
    if not paths:
        raise NotFoundError(f"{_no_sockets(args.socket_dir)}: nothing to evict from")
    results = await _status(paths, min(args.timeout, 10.0))
    found, now = _served_of(args, results)
    if not found:
        cache: FingerprintCache = {}
        served = [
            f"{checkpoint_of(m)} {rank_of(m.key)}, fingerprint "
            + fingerprint_of(m.key, stale_of(m.key, m.source, cache, content=False) if m.source else None)
            + f" on {p.name}"
            for p, r in results
            if isinstance(r, StatusReply)
            for m in r.models
            if not r.software.startswith("wcache-keeper/")
        ]
        where = args.socket_path or args.socket_dir or default_socket_dir()
        what = "stale model" if args.stale else "model"
        raise NotFoundError(
            f"no {what} of {args.model} matching the options given is served by the daemons at {where}"
            + (f"; they serve: {'; '.join(served)}" if served else " (they serve nothing)"),
            details={"served": served},
        )
    if len(found) > 1 and not (args.all or args.stale):
        stale = sum(bool(f.stale) for f in found)
        print(
            f"wcache evict: {len(found)} models of {args.model} are served; pass the options of one, or --all"
            + (f" (--stale: the {stale} stale one{'s' if stale > 1 else ''})" if stale else "")
            + ":\n"
            + "\n".join(f"  {_options(f, found, now)}    ({f.describe()} on {f.socket})" for f in found),
            file=sys.stderr,
        )
        return 1
    for f in found:
        key = key_from_wire(dict(f.model.key))  # a deposit's recipe key, recipe fields and all
        ev = await WCacheClient(f.socket, wait_for_daemon=0).evict(key, timeout=args.timeout)
        print(f"evicted {f.describe()} from {f.socket}: {format_size(ev.bytes)} freed")
    return 0


async def _manage(args: argparse.Namespace) -> int:
    try:
        if args.cmd == "evict":
            return await _evict(args)
        from wcache.paths import socket_name
        from wcache.server.startup import rank_spec

        path = args.socket_path or Path(args.socket_dir or default_socket_dir()) / socket_name(args.tp_rank)
        try:  # the directories of the models the budget may evict: the reply names their keys only
            served = (await WCacheClient(path, wait_for_daemon=0).status(timeout=min(args.timeout, 10.0))).models
        except WCacheError:  # the PRELOAD says why (or waits for a daemon coming back)
            served = ()
        sources = {json.dumps(m.key, sort_keys=True): m.source for m in served}
        r = await WCacheClient(path).preload(rank_spec(args), timeout=args.timeout)
        gone = "; ".join(
            f"{checkpoint_named(k, sources.get(json.dumps(k, sort_keys=True), ''))} {rank_of(k)}, "
            f"fingerprint {fingerprint_of(k)}"
            for k in r.evicted
        )
        print(
            f"resident: {r.tensors} tensors, {format_size(r.bytes)}, loaded in {r.load_seconds:.2f} s"
            + (f"; evicted {gone}" if gone else "")
        )
    except WCacheError as exc:
        from wcache.server.startup import pytorch_bin_hint

        hint = (
            pytorch_bin_hint(args.model)
            if not isinstance(exc, CheckpointError) or "PyTorch .bin" not in exc.message
            else ""
        )
        print(
            f"wcache {args.cmd}: {type(exc).__name__}: {exc.message}" + (f". {hint}" if hint else ""), file=sys.stderr
        )
        return 1
    return 0


def _make_checkpoint(args: argparse.Namespace, prog: str = "wcache make-checkpoint") -> int:
    import time

    from wcache.synthetic import make_llama_checkpoint, shape_for_size

    try:
        shape = shape_for_size(args.size)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    blocker = next((p for p in (args.dir, *args.dir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # DIR, or a directory it would be made in, is a file
        what = "" if blocker == args.dir else f" cannot be made: {blocker}"
        print(
            f"{prog}: {args.dir}{what} is a file, not a directory: name a new directory, or one to overwrite",
            file=sys.stderr,
        )
        return 2
    shards = args.shards if args.shards > 0 else max(1, -(-shape.nbytes() // (2 * 10**9)))
    t0 = time.perf_counter()
    try:
        root = make_llama_checkpoint(args.dir, shape, shards=shards, seed=args.seed)
    except OSError as exc:  # no permission, no space, ...
        print(f"{prog}: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {root}: {len(shape.tensors())} tensors, {format_size(shape.nbytes())} of bf16 in {shards} file(s) "
        f"({time.perf_counter() - t0:.1f} s; LlamaForCausalLM, hidden {shape.hidden}, {shape.layers} layers). "
        f"Serve it: wcache-server --model {root}"
    )
    return 0


def _hex_prefix(text: str) -> str:
    """``--fingerprint``: hex digits, the start of a key's fingerprint."""
    if not text or any(c not in "0123456789abcdef" for c in text.lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not hex digits (the start of a fingerprint)")
    return text.lower()


def _recipe_field(text: str) -> str:
    """``--recipe``: FIELD=VALUE of a recipe field (not one of the checkpoint's key fields)."""
    name, eq, _ = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIELD=VALUE")
    if name in _KEY_FIELDS:
        raise argparse.ArgumentTypeError(f"{name} is a checkpoint key field, not a recipe field: use its own option")
    return text


def _where(p: argparse.ArgumentParser) -> None:
    w = p.add_mutually_exclusive_group()
    w.add_argument("--socket-path", type=Path, help="one daemon's socket file")
    w.add_argument(
        "--socket-dir", type=Path, help=f"directory of the daemons' sockets (default: {DEFAULT_SOCKET_DIR_HELP})"
    )


EVICT_HELP = (
    "Drop a checkpoint's model from the daemon of its rank (refused while engines hold leases). The models the "
    "daemons serve of DIR (loaded from it, or of the fingerprint its files give now) are found through STATUS, its deposits (engines' "
    "write-back: DIR [ENGINE deposit] in wcache status) included, and the options given narrow them: when one "
    "model is left it is evicted; when several are, nothing is evicted and each is listed with the options that "
    "pick it (--no-deposit the checkpoint's own model, --deposit ENGINE and --recipe FIELD=VALUE a deposit, "
    "--fingerprint HEX one of two loads of a directory whose files changed); --all evicts every one, --stale every "
    "one the directory no longer gives. With --tp-rank and --tp-size and none of those options, the checkpoint's "
    "own key they name is evicted (its daemon says how it differs from what it serves)."
)


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="wcache", description=plain_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{status,preload,evict,make-checkpoint}")
    st = sub.add_parser(
        "status",
        help="what each daemon serves, and who holds leases (exit 1 if one is unreachable)",
        description="One row per model of each daemon socket found, then, for each daemon on a GPU or with "
        "--host-tier, a line of its free device memory and host-tier use; exit 0 only if every one answered.",
    )
    _where(st)
    st.add_argument("--json", action="store_true", help="print the STATUS_REPLY frames as JSON, one per socket")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each daemon (default 5)")
    for name, help_ in (
        ("preload", "load a checkpoint into the daemon of its rank and keep it resident"),
        ("evict", "drop a checkpoint's model from the daemon of its rank (refused while engines hold leases)"),
    ):
        sp = sub.add_parser(name, help=help_, description=EVICT_HELP if name == "evict" else help_)
        sp.add_argument("model", type=Path, metavar="DIR", help="checkpoint directory (safetensors + config.json)")
        if name == "preload":
            sp.add_argument(
                "--tp-rank", type=int, default=0, help="tensor-parallel rank, in [0, --tp-size) (default 0)"
            )
            sp.add_argument("--tp-size", type=int, default=1, help="tensor-parallel world size (default 1)")
        else:
            any_ = "(default: whatever the daemons serve of the checkpoint)"
            sp.add_argument("--tp-rank", type=int, help=f"tensor-parallel rank, in [0, --tp-size) {any_}")
            sp.add_argument("--tp-size", type=int, help=f"tensor-parallel world size {any_}")
            sp.add_argument(
                "--fingerprint",
                type=_hex_prefix,
                metavar="HEX",
                help="only the model whose key's fingerprint starts so (the FINGERPRINT column of wcache status) "
                "(default: any)",
            )
            kind = sp.add_mutually_exclusive_group()
            kind.add_argument(
                "--deposit",
                nargs="?",
                const="",
                metavar="ENGINE",
                help="only deposits (engines' write-back: DIR [ENGINE deposit] in wcache status), of ENGINE if given "
                "(default: deposits and the checkpoint's own models alike)",
            )
            kind.add_argument(
                "--no-deposit", action="store_true", help="only the checkpoint's own models, none of its deposits"
            )
            sp.add_argument(
                "--recipe",
                action="append",
                type=_recipe_field,
                metavar="FIELD=VALUE",
                help="only deposits whose recipe key has FIELD equal to VALUE (e.g. quantization=fp8; repeatable) "
                "(default: any)",
            )
            pick = sp.add_mutually_exclusive_group()
            pick.add_argument(
                "--all",
                action="store_true",
                help="evict every model of the checkpoint that matches, deposits included, not just one",
            )
            pick.add_argument(
                "--stale",
                action="store_true",
                help="evict every model of the checkpoint that matches and that the directory no longer gives (its "
                "files changed, or are gone, since it was loaded: marked (stale) by wcache status)",
            )
        sp.add_argument(
            "--dtype",
            default=None,
            choices=["auto", "bfloat16", "float16", "float32", "float64"],
            help="dtype the model is (to be) served in (default: "
            + ("as stored)" if name == "preload" else "any; with --tp-rank and --tp-size: as stored)"),
        )
        sp.add_argument("--shard-plan", type=Path, help="JSON sharding plan (format: docs/shard-plans.md)")
        sp.add_argument(
            "--transform",
            default="" if name == "preload" else None,
            metavar="MODULE:FUNCTION",
            help="load-time transform, as wcache-server's" + ("" if name == "preload" else " (default: any)"),
        )
        _where(sp)
        sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the daemon (default 600)")
    _make_checkpoint_options(
        sub.add_parser(
            "make-checkpoint",
            help="write a small random Llama-shaped checkpoint to try the daemon on (python -m wcache.synthetic)",
            description=MAKE_CHECKPOINT_HELP,
        )
    )
    return ap


MAKE_CHECKPOINT_HELP = (
    "Write a Llama-shaped safetensors checkpoint of random bf16 weights into DIR, made locally (no download): "
    "config.json and the weights, in one file (model.safetensors) or in several (--shards; by default one per 2 GB) "
    "with their index (model.safetensors.index.json). Serve it with wcache-server --model DIR."
)


def _make_checkpoint_options(mk: argparse.ArgumentParser) -> None:
    """``wcache make-checkpoint``'s arguments (``python -m wcache.synthetic``'s too)."""
    mk.add_argument("dir", type=Path, help="directory to write (created; its files are replaced)")
    mk.add_argument(
        "--size",
        type=size_arg,
        default=100 * 10**6,
        metavar="SIZE",
        help="about this many bytes of weights, e.g. 10MB, 311MB (the demo's), 16GB (Llama-3-8B's) (default 100MB)",
    )
    mk.add_argument("--shards", type=int, default=0, help="safetensors files (default: one per 2 GB, at least one)")
    mk.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")


def make_checkpoint_main(prog: str, argv: list[str] | None = None) -> int:
    """``wcache make-checkpoint`` as a command of its own, named ``prog`` in its help and errors (``python -m
    wcache.synthetic``)."""
    p = CommandParser(prog=prog, description=MAKE_CHECKPOINT_HELP)
    _make_checkpoint_options(p)
    return _make_checkpoint(p.parse_args(argv), prog)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    top = build_parser()
    args = top.parse_args(argv)
    # a check of a subcommand's options is its parser's error: ``wcache evict: error: ... (wcache evict --help ...)``
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[args.cmd]
    if args.cmd in ("preload", "evict"):
        rank, size = args.tp_rank, args.tp_size
        problem = (
            tp_problem(0 if rank is None else rank, size, flags=True)
            if size is not None
            else f"--tp-rank {rank} must be at least 0"
            if rank is not None and rank < 0
            else None
        )
        if problem is not None:
            p.error(problem)
        if args.cmd == "evict" and args.recipe and args.no_deposit:
            p.error("--recipe picks deposits: it cannot go with --no-deposit")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that went away raises here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader of stdout is gone (``wcache status --json | head``): no more to say, and no traceback when the
        # interpreter flushes stdout at exit (Python's documented remedy: stdout pointed at /dev/null)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.cmd == "make-checkpoint":
        return _make_checkpoint(args)
    if args.cmd in ("preload", "evict"):
        return asyncio.run(_manage(args))
    paths = _sockets(args)
    if not paths:
        print(f"wcache: {_no_sockets(args.socket_dir)}", file=sys.stderr)
        return 1
    results = asyncio.run(_status(paths, args.timeout))
    cache: FingerprintCache = {}
    stale = {p: _stale(r, cache) if isinstance(r, StatusReply) else [] for p, r in results}
    if args.json:
        print(
            json.dumps(
                {str(p): (_to_json(r, stale[p]) if isinstance(r, StatusReply) else {"error": r}) for p, r in results},
                indent=2,
                default=str,
            )
        )
    else:
        now = time.time()
        rows = [HEADER]
        for p, r in results:
            rows += _rows(p, r, now, stale[p])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for p, r in results:
            line = _summary(p, r) if isinstance(r, StatusReply) else ""
            if line:
                print(line)
        dirs = sorted(
            {
                str(m.source)
                for p, r in results
                if isinstance(r, StatusReply) and not r.software.startswith("wcache-keeper/")
                for m, s in zip(r.models, stale[p])
                if s
            }
        )
        if dirs:
            opt = "--socket-path" if args.socket_path else "--socket-dir" if args.socket_dir else ""
            where = f" {opt} {shlex.quote(str(args.socket_path or args.socket_dir))}" if opt else ""
            print(
                "(stale): the checkpoint's files changed, or are gone, since the model was loaded; evict such models "
                "with: " + "; ".join(f"wcache evict {shlex.quote(d)} --stale{where}" for d in dirs)
            )
    return 0 if all(isinstance(r, StatusReply) for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
