"""The headline figures of a gpu_suite.sh run, one line each, from the JSON and junit files it wrote.

    python benchmarks/suite_summary.py DIR      # DIR: the suite's raw output folder

Read by whoever reads ``summary.txt`` (the device call's short answer); the files themselves are in the
suite's tarball. A figure whose file is missing is left out.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _median(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    m = v.get("median") if isinstance(v, dict) else v
    return float(m) if isinstance(m, (int, float)) else None


def _fmt(label: str, value: float | None, unit: str = "", digits: int = 2) -> str | None:
    return None if value is None else f"{label} {value:.{digits}f}{unit}"


def lines(raw: Path) -> list[str]:
    out: list[str | None] = []
    for name in ("gpu_tests.xml", "fp8_tests.xml"):
        try:
            root = ET.parse(raw / name).getroot()
        except (OSError, ET.ParseError):
            continue
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        out.append(f"{name}: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
    for name in ("fresh_engine", "fresh_engine_moe"):
        d = _load(raw / f"{name}.json")
        if d is None:
            continue
        out.append(_fmt(f"{name}: restart_weight_path_ms", _median(d, "restart_weight_path_ms"), " (median)"))
        out.append(_fmt(f"{name}: first_fetch_fresh_engine_ms", _median(d, "first_fetch_fresh_engine_ms"), " (median)"))
        out.append(_fmt(f"{name}: first_fetch_over_per_tensor_ipc", d.get("first_fetch_over_per_tensor_ipc"), "", 3))
        out.append(f"{name}: key_proven {d.get('key_proven_samples')} phases_ms_median {d.get('phases_ms_median')}")
        for probe in ("touch_probe", "map_probe"):  # where the first touch and the first mapping go (CUDA, dense)
            if isinstance(d.get(probe), dict):
                out.append(f"{name}: {probe} {d[probe]}")
    d = _load(raw / "cold_load.json")
    if d is not None:
        runs = d.get("runs", {})
        cold = {n: r.get("cold_all_s") for n, r in runs.items()}
        out.append(
            f"cold_load: cold seconds {cold}; wcache warm {runs.get('wcache', {}).get('warm', {}).get('seconds')}"
        )
        out.append(
            _fmt("cold_load: wcache_over_fastsafetensors_cold", d.get("wcache_over_fastsafetensors_cold"), "", 3)
        )
        out.append(f"cold_load: pairs {d.get('pairs_wcache_over_fastsafetensors')}")
    d = _load(raw / "keeper_restart.json")
    if d is not None:
        out.append(f"keeper_restart: spawn_to_ready_s {d.get('keeper_restart_spawn_to_ready_s')}")
    for name in ("fleet_fill-host", "fleet_fill-host-tcp", "fleet_fill-cuda", "fleet_fill-cuda-tcp"):
        d = _load(raw / f"{name}.json")
        if d is None:
            continue
        out.append(_fmt(f"{name}: raw_gb_s", d.get("raw_gb_s")))
        fill = d.get("fill")
        if isinstance(fill, dict):
            out.append(_fmt(f"{name}: fill_over_nixl_raw", fill.get("fill_over_nixl_raw"), "", 3))
            scaling = fill.get("scaling") or []
            agg = {t.get("targets"): _median(t, "aggregate_gb_s") for t in scaling if isinstance(t, dict)}
            out.append(f"{name}: targets -> aggregate_gb_s { ({n: round(g, 2) for n, g in agg.items() if g}) }")
    return [line for line in out if line]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(lines(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
