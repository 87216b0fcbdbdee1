"""The /metrics text under the reference parser (tests/server/exposition.py): exact values, escaped labels, the
names and labels dashboards use, one series per resident model, and the parser check's own teeth on broken
renders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server import exposition
from wcache.plan.key import RankSpec
from wcache.server import metrics
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.load import load_model
from wcache.server.metrics import BUCKETS, Metrics
from wcache.server.store import Store
from wcache.server.tier import HostTier

#: a key label with each character the format escapes
ODD_KEY = 'Llama@ab12 "q"\\tp0\nx'
#: past six significant digits (an 8B model's bf16 slab), which ``{:g}`` would round
SLAB_BYTES = 16_060_522_496


def _metrics() -> Metrics:
    m = Metrics()
    for s in (0.0003, 0.0007, 0.004, 3.0):  # the last one above every finite bucket
        m.observe_fetch("zero_copy", s)
    m.observe_fetch("copy", 0.03)
    m.releases = 1_234_567
    m.connections_total = 7
    m.errors["KEY_MISMATCH"] += 2
    return m


def _render(m: Metrics, **kw: object) -> str:
    args: dict[str, object] = {
        "resident": [("host", ODD_KEY, "id1", SLAB_BYTES), ("host_tier", "plain", "plain", 4096)],
        "leases": 3,
        "connections": 2,
        "uptime": 123456.789,
        "load_seconds": 0.25,
        "kept": 1,
    }
    return m.render(**(args | kw))  # type: ignore[arg-type]


def test_render_parses_with_exact_values_and_escaped_labels() -> None:
    fam = exposition.parse(_render(_metrics()))
    v = exposition.value
    assert v(fam, "wcache_resident_bytes", tier="host", key=ODD_KEY, key_id="id1") == SLAB_BYTES
    assert v(fam, "wcache_resident_bytes", tier="host_tier", key="plain", key_id="plain") == 4096
    assert v(fam, "wcache_releases_total") == 1_234_567
    assert v(fam, "wcache_uptime_seconds") == 123456.789
    assert v(fam, "wcache_fetches_total", mode="zero_copy") == 4 and v(fam, "wcache_fetches_total", mode="copy") == 1
    assert v(fam, "wcache_errors_total", code="KEY_MISMATCH") == 2
    assert (v(fam, "wcache_leases"), v(fam, "wcache_connections"), v(fam, "wcache_kept_models")) == (3, 2, 1)
    assert v(fam, "wcache_connections_total") == 7
    buckets = {s.labels["le"]: s.value for s in fam["wcache_fetch_seconds"].samples if s.name.endswith("_bucket")}
    assert (buckets["0.0005"], buckets["0.001"], buckets["0.005"], buckets["0.05"], buckets["1"]) == (1, 2, 3, 4, 4)
    assert buckets["+Inf"] == v(fam, "wcache_fetch_seconds_count") == 5
    assert v(fam, "wcache_fetch_seconds_sum") == pytest.approx(3.035)


def test_the_names_and_labels_dashboards_use_stay() -> None:
    """Every name, kind and label set a dashboard may query (adding metrics is free; renaming is not)."""
    fam = exposition.parse(_render(_metrics()))
    used = {
        "wcache_resident_bytes": ("gauge", {"tier", "key", "key_id"}),
        "wcache_leases": ("gauge", set()),
        "wcache_kept_models": ("gauge", set()),
        "wcache_connections": ("gauge", set()),
        "wcache_connections_total": ("counter", set()),
        "wcache_fetches_total": ("counter", {"mode"}),
        "wcache_releases_total": ("counter", set()),
        "wcache_errors_total": ("counter", {"code"}),
        "wcache_fetch_seconds": ("histogram", {"le"}),
        "wcache_uptime_seconds": ("gauge", set()),
        "wcache_load_seconds": ("gauge", set()),
    }
    for name, (kind, labels) in used.items():
        assert fam[name].type == kind, name
        assert {k for s in fam[name].samples for k in s.labels} == labels, name
    les = [s.labels["le"] for s in fam["wcache_fetch_seconds"].samples if s.name.endswith("_bucket")]
    assert les == [f"{b:g}" for b in BUCKETS] + ["+Inf"]  # le="1", not "1.0": label values are matched as text
    assert "wcache_kept_models" not in exposition.parse(_render(Metrics(), kept=None))  # only with --keeper


def _drop_line(prefix: str) -> Callable[[str], str]:
    return lambda text: "".join(line for line in text.splitlines(keepends=True) if not line.startswith(prefix))


def _twice_line(prefix: str) -> Callable[[str], str]:
    return lambda text: "".join(line * (1 + line.startswith(prefix)) for line in text.splitlines(keepends=True))


@pytest.mark.parametrize(
    "breaks",
    [
        pytest.param(_drop_line('wcache_fetch_seconds_bucket{le="+Inf"}'), id="no-inf-bucket"),
        pytest.param(_drop_line("# TYPE wcache_leases"), id="no-type-line"),
        pytest.param(_drop_line("# HELP wcache_leases"), id="no-help-line"),
        pytest.param(lambda t: t.replace("wcache_releases_total", "wcache_releases"), id="counter-without-total"),
        pytest.param(lambda t: t.replace('{le="0.01"} 3', '{le="0.01"} 1'), id="buckets-not-cumulative"),
        pytest.param(lambda t: t.replace("wcache_fetch_seconds_count 5", "wcache_fetch_seconds_count 6"), id="count"),
        pytest.param(lambda t: t.replace("# TYPE wcache_leases gauge", "# TYPE wcache_leases summary"), id="kind"),
        pytest.param(lambda t: t + "wcache_leases 1\n", id="sample-outside-its-block"),
        pytest.param(lambda t: t.rstrip("\n"), id="no-final-newline"),
        pytest.param(_twice_line('wcache_resident_bytes{tier="host",'), id="one-series-twice"),
    ],
)
def test_the_parser_check_refuses_a_broken_render(breaks: Callable[[str], str]) -> None:
    good = _render(_metrics())
    exposition.parse(good)
    broken = breaks(good)
    assert broken != good
    with pytest.raises(ValueError):
        exposition.parse(broken)


def test_the_parser_check_refuses_unescaped_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_label", lambda v: v)
    with pytest.raises(ValueError):
        exposition.parse(_render(_metrics()))


def test_every_resident_model_is_one_series_of_its_own(ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint and its transformed variant have one ``key`` label (``key.short()`` leaves the transform out):
    each sample names its whole key too (``key_id``, the key's host-tier entry name), so the two are two series.
    Before, they were one series twice, and Prometheus kept one model's bytes."""
    backend = HostBackend()
    plain = load_model(RankSpec(ckpt), backend=backend, threads=2)
    fused = load_model(RankSpec(ckpt, transform="wcache.transforms:fuse_llama_qkv_gate_up"), backend=backend)
    store = Store(backend, [plain, fused])
    try:
        assert plain.key.short() == fused.key.short()
        fam = exposition.parse(Daemon(store, tmp_path / "wcache.sock", software="wcache/test").render_metrics())
        for m in (plain, fused):
            labels = {"tier": "host", "key": m.key.short(), "key_id": HostTier.entry_id(m.key)}
            assert exposition.value(fam, "wcache_resident_bytes", **labels) == m.slab_bytes
    finally:
        store.close()
