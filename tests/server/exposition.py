"""The daemon's /metrics text read by the reference implementation of the Prometheus text format (0.0.4):
prometheus_client's parser, plus the rules that parser lets pass. test_metrics, test_daemon and test_fetch
read the text through ``parse``."""

from __future__ import annotations

import math
import re

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["parse", "value"]

_DECLARATION = re.compile(r"# (HELP|TYPE) (\S+)(?: (.*))?")


def parse(text: str) -> dict[str, Metric]:
    """The metric families of ``text`` by the name their TYPE line declares; ValueError where the parser
    refuses the text, and where it would let pass: a text not ending in a newline; a name without exactly one
    HELP and one TYPE line (HELP first), or a TYPE other than counter, gauge or histogram; a sample outside
    its family's block (the parser files it as an untyped family of its own); a counter not named
    ``*_total``, or below zero; a histogram whose buckets do not rise in ``le`` to ``+Inf`` with cumulative
    counts, whose ``+Inf`` bucket is not its ``_count``, or that has no ``_sum``; two samples of one name and label
    set (one series: Prometheus keeps one of them)."""
    if not text.endswith("\n"):
        raise ValueError("the text does not end in a newline")
    declared: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    for line in text.splitlines():
        m = _DECLARATION.fullmatch(line)
        if m is not None:
            declared.setdefault(m[2], []).append(m[1])
            if m[1] == "TYPE":
                kinds[m[2]] = m[3] or ""
    for name, seen in declared.items():
        if seen != ["HELP", "TYPE"]:
            raise ValueError(f"{name}: declared by {seen}, not one HELP then one TYPE line")
        if kinds[name] not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{name}: TYPE {kinds[name]!r}")
        if kinds[name] == "counter" and not name.endswith("_total"):
            raise ValueError(f"{name}: a counter's name ends in _total")
    families: dict[str, Metric] = {}
    for f in text_string_to_metric_families(text):
        name = f.name + "_total" if f.type == "counter" else f.name
        if f.type == "untyped" or name not in kinds or name in families:
            raise ValueError(f"{[s.name for s in f.samples]}: samples outside their family's HELP/TYPE block")
        families[name] = f
        series = [(s.name, tuple(sorted(s.labels.items()))) for s in f.samples]
        if len(set(series)) != len(series):
            raise ValueError(f"{name}: two samples of one series: {sorted(series)}")
        if f.type == "counter" and any(s.value < 0 for s in f.samples):
            raise ValueError(f"{name}: a counter below zero")
        if f.type == "histogram":
            _check_histogram(name, f)
    if missing := sorted(set(kinds) - set(families)):
        raise ValueError(f"{missing}: declared, not parsed")
    return families


def _check_histogram(name: str, f: Metric) -> None:
    buckets = [(float(s.labels["le"]), s.value) for s in f.samples if s.name == name + "_bucket"]
    count = [s.value for s in f.samples if s.name == name + "_count"]
    if not buckets or buckets[-1][0] != math.inf:
        raise ValueError(f"{name}: no +Inf bucket last")
    if any(a[0] >= b[0] or a[1] > b[1] for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name}: buckets not rising in le with cumulative counts: {buckets}")
    if count != [buckets[-1][1]] or not any(s.name == name + "_sum" for s in f.samples):
        raise ValueError(f"{name}: _count {count} is not the +Inf bucket {buckets[-1][1]}, or no _sum")


def value(families: dict[str, Metric], name: str, **labels: str) -> float:
    """The value of the one sample ``name`` (a sample name: ``wcache_fetch_seconds_count``) with ``labels``."""
    found = [s.value for f in families.values() for s in f.samples if s.name == name and s.labels == labels]
    if len(found) != 1:
        raise KeyError(f"{name}{labels}: {len(found)} samples")
    return found[0]
