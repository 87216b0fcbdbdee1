"""The layering (docs/architecture.md): the backend boundary, the torch-free daemon start, who imports whom.

Everything device-specific lives in wcache/server/backends/ (and wcache/_cuda.py): the read primitives, the
loader, the load pipeline, the store, the tier, the daemon and the reclaim check name no device API, and the
staging budget is the backend's. The read primitives (server/reads.py) sit below both the loader and the
backends, and the backends never import upwards. No wcache module's top-level imports form a circle, and the
domain package (wcache/plan/) imports in its declared order, its imports inside functions counted too. No
daemon start-up module imports torch at import time; a daemon serving only what its keeper handed back never
imports it.
"""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from wcache import WCacheClient
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.server.process import DaemonProcess

PACKAGE = Path(__file__).resolve().parents[2] / "wcache"
SERVER = PACKAGE / "server"
SHARED = [
    SERVER / f"{m}.py" for m in ("reads", "loader", "load", "store", "tier", "daemon", "service", "listen", "reclaim")
]
#: dotted names and identifiers only a backend may use
DEVICE_NAMES = ("torch.cuda", "cudaHost", "is_cuda", "cuda.bindings", "cuda.cuda", "mem_get_info")
#: modules a daemon imports to start: none may import torch when imported
START_MODULES = [
    "wcache.server.cli",
    "wcache.server.startup",
    "wcache.server.daemon",
    "wcache.server.service",
    "wcache.server.store",
    "wcache.server.load",
    "wcache.server.loader",
    "wcache.server.reads",
    "wcache.server.tier",
    "wcache.server.reclaim",
    "wcache.server.keeper",
    "wcache.server.keeper_link",
    "wcache.server.backends.host",
    "wcache.server.backends.cuda",
    "wcache._cuda",
    "wcache.plan.rank",
]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _device_uses(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if any(d in n for d in DEVICE_NAMES)]  # type: ignore[attr-defined]
    return found


def test_shared_server_modules_name_no_device_api() -> None:
    assert all(p.exists() for p in SHARED)
    bad = [u for p in SHARED for u in _device_uses(p)]
    assert bad == [], "device-specific code belongs in wcache/server/backends/: " + "; ".join(bad)


def _staging_passed(path: Path) -> list[str]:
    """Where ``path`` takes or passes a staging budget: a parameter or a keyword argument named ``staging_bytes``
    (reading a slab's own, ``slab.staging_bytes``, is neither)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            found += [f"{path.name}:{node.lineno}: parameter {x.arg}" for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
        elif isinstance(node, ast.Call):
            found += [f"{path.name}:{node.lineno}: keyword {k.arg}" for k in node.keywords if k.arg]
    return [f for f in found if f.endswith(" staging_bytes")]


def test_the_staging_budget_is_the_backends() -> None:
    """A backend gets its staging budget when it is built (``make_backend``, ``--staging-bytes``) and its slabs carry
    it: no device-blind module takes it or passes it on (it once went store -> loader -> writer through 18 calls)."""
    bad = [u for p in SHARED for u in _staging_passed(p)]
    assert bad == [], "the staging budget is the backend's (Slab.staging_bytes): " + "; ".join(bad)
    assert _staging_passed(SERVER / "startup.py")  # the check sees it where the backend is built


def test_the_check_sees_device_code() -> None:
    """The check above would catch what these modules held before (the CUDA backend still does)."""
    assert any("torch.cuda" in u for u in _device_uses(SERVER / "backends" / "cuda.py"))


def test_no_start_module_imports_torch_at_top_level() -> None:
    """torch is imported inside the functions that need it (a load's casts, transforms, CUDA copies)."""
    for mod in START_MODULES:
        path = Path(__file__).resolve().parents[2] / (mod.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; `if TYPE_CHECKING:` blocks are not run
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), f"{mod} imports torch"
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "torch", f"{mod} imports from torch"


def test_importing_the_daemon_start_path_loads_no_torch() -> None:
    code = f"import sys\nfor m in {START_MODULES!r}: __import__(m)\nsys.exit(1 if 'torch' in sys.modules else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, "importing the daemon's start-up modules imported torch\n" + out.stderr


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's libraries mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/PID/maps")
async def test_a_daemon_restarted_on_its_keeper_serves_without_torch_and_imports_it_for_a_cast(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    first = daemon_factory(ckpt, "--keeper")
    first.stop(signal.SIGKILL)

    second = daemon_factory(ckpt, "--keeper")
    (served,) = (await WCacheClient(second.socket).status()).models
    assert served.key == key.to_wire()
    assert not _maps_torch(second.pid), "a daemon serving only kept models imported torch"
    async with await WCacheClient(second.socket).fetch(key) as w:  # served from the kept slab
        assert w.server.server_pid == second.pid and len(w.keys()) > 0
    assert not _maps_torch(second.pid)

    # a load that needs torch (a dtype cast) imports it then, and is served
    r = await WCacheClient(second.socket).preload(RankSpec(ckpt, dtype="float32"))
    assert r.bytes > served.bytes
    assert _maps_torch(second.pid)


# ------------------------------------------------------------------ who imports whom
#: the domain package's modules (wcache/plan/__init__.py), each importing only those before it
PLAN_ORDER = ("checkpoint", "quant", "sharding", "layout", "reshard", "key", "facts", "recipe", "rank")
#: all the domain package may import of the rest of wcache: the errors, the bounded file reads, the protocol's
#: records, limits and frames (a key is a wire object)
PLAN_BELOW = ("wcache.errors", "wcache.files", "wcache.proto")


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs or declares at its top level: in ``if TYPE_CHECKING:`` blocks too (a
    type's module is a dependency all the same), in other ``if`` and ``try`` blocks, but not inside functions or
    classes (an import a function makes when it is called, for start-up time, is deliberate)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _top_level_imports(node.body) + _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_level_imports(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _top_level_imports(handler.body)
    return found


def _every_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, inside its functions and classes too: one a function makes is a
    dependency when it runs, so it may point down a layer (for start-up time), never up one."""
    return [n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)]


def import_graph(root: Path, *, inside_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package its top-level imports (``inside_functions``: all its imports)
    name. ``from a.b import c`` names ``a.b.c`` where that is a module, else ``a.b``; relative imports are
    resolved. A package's own ``__init__`` re-exporting names of modules inside it is not counted: that is how a
    package shows its API, not a dependency of layers."""
    imports = _every_import if inside_functions else _top_level_imports
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for named in targets:
                target = named
                while target and target not in mods:
                    target = target.rpartition(".")[0]  # a name defined in a module: that module
                if target and target != name and not (path.name == "__init__.py" and target.startswith(name + ".")):
                    deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_wcache() -> None:
    """Nothing imports upwards: no circle among every wcache module's top-level imports (TYPE_CHECKING ones too)."""
    found = sorted(sorted(c) for c in circles(import_graph(PACKAGE)))
    assert found == [], f"import circles (docs/architecture.md says who may import whom): {found}"


def test_the_circle_check_sees_circles(tmp_path: Path) -> None:
    """A circle through a TYPE_CHECKING import and a relative one, as backends/base <-> loader once was, is found;
    a package re-exporting its modules, and an import inside a function, are not circles."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub.base import Slab\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.loader import Job\n"
    )
    (pkg / "loader.py").write_text("import pkg\nfrom .sub.base import Slab\ndef f():\n    from pkg import late\n")
    (pkg / "late.py").write_text("from pkg.loader import f\n")
    assert circles(import_graph(pkg)) == {frozenset({"pkg.sub.base", "pkg.loader"})}


def order_violations(
    graph: dict[str, set[str]], package: str, order: tuple[str, ...], below: tuple[str, ...]
) -> list[str]:
    """What breaks ``package``'s declared order in ``graph``: a module importing one of the package declared after
    it (or not declared), or a module of the rest of the tree outside ``below``."""
    found = []
    for i, short in enumerate(order):
        name = f"{package}.{short}"
        for dep in sorted(graph[name]):
            if dep.startswith(package + "."):
                if dep.removeprefix(package + ".") not in order[:i]:
                    found.append(f"{name} imports {dep}, declared after it")
            elif dep != package and not dep.startswith(below):
                found.append(f"{name} imports {dep}, which is not below the package")
    return found


def test_the_domain_package_imports_in_its_order() -> None:
    """Each wcache.plan module imports only those before it (PLAN_ORDER) and, of the rest of wcache, PLAN_BELOW
    only — every import counted, those inside functions too, so no upward edge hides in a function (the key once
    reached the planner so, and the layout the key at the top: key -> rank -> layout -> key). The package's
    ``__init__`` imports nothing: an engine's restart loads it with the key."""
    graph = import_graph(PACKAGE, inside_functions=True)
    declared = {f"wcache.plan.{m}" for m in PLAN_ORDER}
    assert {m for m in graph if m.startswith("wcache.plan.")} == declared, "a new wcache.plan module joins PLAN_ORDER"
    assert order_violations(graph, "wcache.plan", PLAN_ORDER, PLAN_BELOW) == []
    assert graph["wcache.plan"] == set()


def test_only_the_planner_composes_the_domain() -> None:
    """The planner (``rank``) is the one module that brings the checkpoint, the shard plan, the layout and the key
    together; the server's modules take a plan from it (``plan_rank``) rather than composing the parts."""
    graph = import_graph(PACKAGE, inside_functions=True)
    parts = {f"wcache.plan.{m}" for m in ("checkpoint", "sharding", "layout", "key")}
    assert sorted(m for m in graph if parts <= graph[m]) == ["wcache.plan.rank"]


def test_the_order_check_sees_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    """The domain's old shape — the key reaching the planner inside a function, the planner the layout under
    ``TYPE_CHECKING``, the layout the key at the top — breaks the order twice; the top-level graph alone sees
    one of the two."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "key.py").write_text("def from_checkpoint():\n    from pkg.rank import RankSpec\n")
    (pkg / "rank.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .layout import Layout\n"
    )
    (pkg / "layout.py").write_text("from pkg.key import LAYOUT_VERSION\n")
    order = ("layout", "key", "rank")
    assert order_violations(import_graph(tmp_path / "pkg", inside_functions=True), "pkg", order, ()) == [
        "pkg.layout imports pkg.key, declared after it",
        "pkg.key imports pkg.rank, declared after it",
    ]
    assert order_violations(import_graph(tmp_path / "pkg"), "pkg", order, ()) == [
        "pkg.layout imports pkg.key, declared after it"
    ]


def test_reads_are_below_the_loader_and_the_backends() -> None:
    """The read primitives import no server module (the loader and the backends sit above them); a backend imports
    only other backend modules and the read primitives from the server: never the loader, the store or the daemon."""
    graph = import_graph(PACKAGE)
    assert not {m for m in graph["wcache.server.reads"] if m.startswith("wcache.server")}
    for name in [m for m in graph if m.startswith("wcache.server.backends.")]:
        above = {
            m for m in graph[name] if m.startswith("wcache.server.") and not m.startswith("wcache.server.backends")
        }
        assert above <= {"wcache.server.reads"}, f"{name} imports {sorted(above)}"
    assert "wcache.server.reads" in graph["wcache.server.loader"]
    assert "wcache.server.reads" in graph["wcache.server.backends.host"]
