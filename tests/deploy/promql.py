"""Metric and label names out of PromQL text (dashboard targets, alert rules, the KEDA query): small and strict.
An identifier it does not know as a function or keyword counts as a metric name, so a misspelled function
shows up as an unknown metric instead of passing silently."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

FUNCTIONS = {"rate", "irate", "increase", "sum", "avg", "max", "min", "count", "histogram_quantile", "clamp_min",
             "clamp_max", "abs", "topk", "bottomk", "delta", "deriv", "avg_over_time", "max_over_time",
             "min_over_time", "sum_over_time", "label_values", "vector", "scalar", "time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"')
_IDENT = re.compile(r"(?<![\w.:$])[a-zA-Z_:][\w:]*")


@dataclass(slots=True)
class Names:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def names(expr: str, into: Names | None = None) -> Names:
    out = into if into is not None else Names()
    text = re.sub(r"\$\{?\w+\}?", "1", expr)       # Grafana variables ($__rate_interval, ${price}, ...)
    text = re.sub(r"\[[^\]]*\]", "", text)          # range selectors: [5m]
    for m in _MATCHERS.finditer(text):
        out.labels.update(_MATCHER.findall(m.group(1)))
        rest = _MATCHER.sub("", m.group(1)).replace(",", "").strip()
        assert not rest, f"unparsed label matchers {m.group(1)!r} in {expr!r}"
    text = _MATCHERS.sub(" ", text)
    for m in _GROUPING.finditer(text):
        out.labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
    text = _GROUPING.sub(" ", text)
    # label_values(metric, label): the second argument is a label.
    text = re.sub(r"label_values\((.*),\s*(\w+)\s*\)", lambda m: (out.labels.add(m.group(2)), m.group(1))[1], text)
    for ident in _IDENT.findall(text):
        if ident not in FUNCTIONS and ident not in KEYWORDS:
            out.metrics.add(ident)
    return out
