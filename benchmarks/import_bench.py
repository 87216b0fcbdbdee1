"""What an engine's restart imports, per module: the least of N ``python -X importtime`` runs (docs/performance.md,
"The restart weight path").

Each run is a fresh interpreter that imports torch (and starts the CUDA context with ``--device cuda:N``: an engine
has both before it asks for weights), then what a fetch loads, in its order: ``import wcache``, ``WCacheClient`` and
``WeightCacheKey`` (the engine's import; computing the key imports nothing more), then what the fetch adds (the
views' module and, with CUDA, the CUDA mapping's modules: loaded while the daemon answers).
For every module imported after torch, the JSON keeps the least self and cumulative microseconds over the runs
(one run's figure moves with whatever else the machine does); ``import_us`` sums the least self times of the
engine's import, ``fetch_adds_us`` those of what the fetch adds. Bytecode is compiled first (``compileall``), as an
installed wcache has it.

    python benchmarks/import_bench.py --out r.json                    # host: no CUDA modules
    python benchmarks/import_bench.py --device cuda:0 --out r.json    # what gpu_suite's imports step runs
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

ENGINE = "from wcache import WCacheClient, WeightCacheKey"
FETCH = "import wcache.client.mapping"


def code(device: str, *, fetch: bool = True) -> str:
    """The run's program: torch (and the CUDA context), the engine's import, then (``fetch``) what a fetch adds."""
    cuda = device.startswith("cuda")
    first = f"import torch; torch.empty(1, device={device!r})" if cuda else "import torch"
    adds = FETCH + (", wcache.client.cuda" if cuda else "")
    return f"{first}; import wcache; {ENGINE}" + (f"; {adds}" if fetch else "")


def one_run(src: str, env: dict[str, str]) -> list[tuple[str, int, int, int]]:
    """(module, self us, cumulative us, depth) of every module imported after torch, in import order."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", src],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the import run failed ({out.returncode}): {src}\n{out.stderr[-2000:]}")
    rows: list[tuple[str, int, int, int]] = []
    after_torch = False
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, cum_us, name = line.removeprefix("import time:").split("|", 2)
        if not self_us.strip().isdigit():
            continue  # the header
        if not after_torch:
            after_torch = name.strip() == "torch"
            continue
        depth = (len(name) - len(name.lstrip(" "))) // 2
        rows.append((name.strip(), int(self_us), int(cum_us), depth))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N (the CUDA context up first, the CUDA modules)")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    compileall.compile_dir(str(REPO / "wcache"), quiet=1)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    src = code(args.device)
    least: dict[str, dict[str, int]] = {}
    order: list[str] = []
    engine_modules: set[str] = set()
    for i in range(args.runs):
        if i == 0:  # which modules the engine's import loads (the rest the fetch adds)
            engine_modules = {name for name, *_ in one_run(code(args.device, fetch=False), env)}
        for name, self_us, cum_us, depth in one_run(src, env):
            row = least.setdefault(name, {"self_us": self_us, "cumulative_us": cum_us, "depth": depth})
            if name not in order:
                order.append(name)
            row["self_us"] = min(row["self_us"], self_us)
            row["cumulative_us"] = min(row["cumulative_us"], cum_us)
    modules = {name: {**least[name], "engine_import": name in engine_modules} for name in order}
    result: dict[str, Any] = {
        "benchmark": "import_bench",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "python": sys.version.split()[0],
        "runs": args.runs,
        "load_average": os.getloadavg(),
        "code": src,
        "definition": "least self / cumulative microseconds of each module over the runs (python -X importtime), "
        "modules imported after torch; import_us: the least self times summed over the engine's import "
        "(import wcache; from wcache import WCacheClient, WeightCacheKey), fetch_adds_us: over what "
        "the fetch imports after it",
        "import_us": sum(m["self_us"] for m in modules.values() if m["engine_import"]),
        "fetch_adds_us": sum(m["self_us"] for m in modules.values() if not m["engine_import"]),
        "modules": modules,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in modules.items():
        print(
            f"{m['self_us']:7d} {m['cumulative_us']:7d} {'  ' * m['depth']}{name}{'' if m['engine_import'] else '  (fetch)'}"
        )
    print(json.dumps({k: result[k] for k in ("device", "runs", "import_us", "fetch_adds_us", "load_average")}))


if __name__ == "__main__":
    main()
