"""A small PromQL reader for the tests of the alert rules and the dashboard: it parses the expressions they use
(selectors with label matchers, ranges, functions, `max by (l) (...)` aggregations, arithmetic, comparisons, `and`)
and evaluates the subset the alert rules use over scrapes recorded from a real job. No Python library parses
PromQL, and Prometheus itself is not installed here; this is the least that checks the rules against real scrapes.

Semantics kept from Prometheus: an instant selector takes each series' newest sample at or before the time (within
LOOKBACK); vector-vector operators match series on their labels less the metric name (one-to-one) or on `by`'s
labels after an aggregation; a comparison keeps the left-hand sample where it holds; `and` keeps the left-hand
series that the right-hand side also has. Simplified: delta() and increase() take last - first of the samples in the
range without extrapolation (increase() adding across counter resets).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

LOOKBACK = 300.0  # s, Prometheus' default staleness
Labels = frozenset  # of (name, value) pairs, the metric name not among them
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)"
                    r"|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<range>\[[^\]]+\])|(?P<op>>=|<=|==|!=|=~|!~|[-+*/<>(){},=]))")
_DURATION = re.compile(r"(\d+)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_AGGREGATIONS = {"max", "min", "sum", "avg", "count"}
_PRECEDENCE = [("and", "or", "unless"), ("==", "!=", ">", "<", ">=", "<="), ("+", "-"), ("*", "/")]


@dataclass
class Node:
    kind: str  # num, sel, call, agg, bin
    value: Any = None
    args: list[Node] = field(default_factory=list)
    matchers: dict[str, str] = field(default_factory=dict)
    range: float | None = None
    by: tuple[str, ...] = ()


def seconds(text: str) -> float:
    """A PromQL duration (1h, 10m, 30s, 1h30m) in seconds; ValueError for anything else."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return float(sum(int(n) * _UNITS[u] for n, u in parts))


class Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise ValueError(f"cannot read {text[pos:]!r} in {text!r}")
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self, want: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.tokens):
            raise ValueError("unexpected end of the expression")
        tok = self.tokens[self.i]
        if want is not None and tok[1] != want:
            raise ValueError(f"expected {want!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.binary(0)
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.peek()!r}")
        return node

    def binary(self, level: int) -> Node:
        if level == len(_PRECEDENCE):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in _PRECEDENCE[level]:
            op = self.take()[1]
            left = Node("bin", op, [left, self.binary(level + 1)])
        return left

    def unary(self) -> Node:
        kind, tok = self.take()
        if kind == "num":
            return Node("num", float(tok))
        if tok == "(":
            inner = self.binary(0)
            self.take(")")
            return inner
        if kind != "name":
            raise ValueError(f"unexpected {tok!r}")
        if tok in _AGGREGATIONS:
            by: tuple[str, ...] = ()
            if self.peek() == "by":
                self.take()
                by = self.names()
            self.take("(")
            args = [self.binary(0)]
            self.take(")")
            if self.peek() == "by":
                self.take()
                by = self.names()
            return Node("agg", tok, args, by=by)
        if self.peek() == "(":
            self.take("(")
            args = [self.binary(0)]
            while self.peek() == ",":
                self.take()
                args.append(self.binary(0))
            self.take(")")
            return Node("call", tok, args)
        node = Node("sel", tok)
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label = self.take()[1]
                self.take("=")
                node.matchers[label] = self.take()[1][1:-1]
                if self.peek() == ",":
                    self.take()
            self.take("}")
        if self.i < len(self.tokens) and self.tokens[self.i][0] == "range":
            text = self.take()[1][1:-1]
            node.range = None if text.startswith("$") else seconds(text)  # Grafana's $__rate_interval
        return node

    def names(self) -> tuple[str, ...]:
        self.take("(")
        out = []
        while self.peek() != ")":
            out.append(self.take()[1])
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(out)


def parse(expr: str) -> Node:
    """The expression's tree; ValueError naming what could not be read."""
    return Parser(expr).parse()


def metric_names(node: Node) -> set[str]:
    """Every metric name the expression selects."""
    found = {node.value} if node.kind == "sel" else set()
    for arg in node.args:
        found |= metric_names(arg)
    return found


class Recording:
    """Scrapes of an endpoint at known times: `add(t, text)` parses each with prometheus_client's parser."""

    def __init__(self) -> None:
        self.scrapes: list[tuple[float, dict[tuple[str, Labels], float]]] = []
        self.families: set[str] = set()  # every family's name, those without samples in any scrape too

    def add(self, at: float, text: str) -> None:
        samples = {}
        for family in text_string_to_metric_families(text):
            self.families.add(family.name)
            for s in family.samples:
                samples[(s.name, Labels(s.labels.items()))] = s.value
        self.scrapes.append((at, samples))

    def names(self) -> set[str]:
        """Every sample name seen, and every family's name (a histogram's and a counter's base names too; a family
        served without samples, such as the stragglers when there are none, counts)."""
        out = set(self.families)
        for _, samples in self.scrapes:
            for name, _ in samples:
                out.add(name)
                out.add(re.sub(r"_(total|bucket|count|sum)$", "", name))
        return out

    def times(self) -> list[float]:
        return [t for t, _ in self.scrapes]

    def select(self, node: Node, at: float) -> dict[Labels, Any]:
        """An instant selector's vector at `at`, or a range selector's samples [(t, v)] per series."""
        out: dict[Labels, Any] = {}
        since = at - (node.range if node.range is not None else LOOKBACK)
        for t, samples in self.scrapes:
            if not since < t <= at:
                continue
            for (name, labels), value in samples.items():
                if name != node.value or any(dict(labels).get(k) != v for k, v in node.matchers.items()):
                    continue
                if node.range is None:
                    out[labels] = value
                else:
                    out.setdefault(labels, []).append((t, value))
        return out


def evaluate(node: Node, rec: Recording, at: float) -> dict[Labels, float] | float:
    """The value of `node` at time `at` over `rec`: a vector (labels -> value) or a scalar."""
    if node.kind == "num":
        return node.value
    if node.kind == "sel":
        return rec.select(node, at)
    if node.kind == "call":
        return _call(node, rec, at)
    if node.kind == "agg":
        vector = evaluate(node.args[0], rec, at)
        groups: dict[Labels, list[float]] = {}
        for labels, value in vector.items():
            key = Labels((k, v) for k, v in labels if k in node.by)
            groups.setdefault(key, []).append(value)
        reduce = {"max": max, "min": min, "sum": sum, "count": len, "avg": lambda v: sum(v) / len(v)}[node.value]
        return {k: float(reduce(v)) for k, v in groups.items()}
    return _binary(node.value, evaluate(node.args[0], rec, at), evaluate(node.args[1], rec, at))


def _call(node: Node, rec: Recording, at: float) -> dict[Labels, float]:
    if node.value not in ("delta", "increase"):
        raise ValueError(f"the test evaluator does not evaluate {node.value}()")
    ranged = rec.select(node.args[0], at)
    out = {}
    for labels, points in ranged.items():
        if len(points) < 2:
            continue
        if node.value == "delta":
            out[labels] = points[-1][1] - points[0][1]
        else:
            out[labels] = sum(b - a if b >= a else b for (_, a), (_, b) in zip(points, points[1:], strict=False))
    return out


_COMPARE = {">": float.__gt__, "<": float.__lt__, ">=": float.__ge__, "<=": float.__le__, "==": float.__eq__,
            "!=": float.__ne__}
_ARITH = {"*": float.__mul__, "/": lambda a, b: a / b if b else float("nan"), "+": float.__add__,
          "-": float.__sub__}


def _binary(op: str, left: Any, right: Any) -> Any:
    if op == "and":
        return {k: v for k, v in left.items() if k in right}
    fn = _COMPARE.get(op) or _ARITH[op]
    if not isinstance(left, dict) and not isinstance(right, dict):
        return float(fn(float(left), float(right)))
    if not isinstance(left, dict):
        pairs = {k: (float(left), v, v) for k, v in right.items()}
    elif not isinstance(right, dict):
        pairs = {k: (v, float(right), v) for k, v in left.items()}
    else:
        pairs = {k: (v, right[k], v) for k, v in left.items() if k in right}
    if op in _COMPARE:
        return {k: keep for k, (a, b, keep) in pairs.items() if fn(float(a), float(b))}
    return {k: float(fn(float(a), float(b))) for k, (a, b, _) in pairs.items()}
