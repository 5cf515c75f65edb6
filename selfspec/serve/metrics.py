"""Counters, gauges and histograms in the Prometheus text exposition format (version 0.0.4).

Thread-safe (the engine thread and the event loop both record), no dependency: the server exposes
``Registry.render()`` at ``/metrics``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

LabelKey = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = (*key, *extra)
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _number(v: float) -> str:
    return ("+Inf" if v > 0 else "-Inf") if math.isinf(v) else repr(float(v))


class Metric:
    """One metric family: a name, a help line, a type, and values per label set."""

    kind = "untyped"

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.lock = threading.Lock()
        self.values: dict[LabelKey, float] = {}

    def _key(self, labels: dict[str, str] | None) -> LabelKey:
        return tuple(sorted((labels or {}).items()))

    def value(self, **labels: str) -> float:
        """The current value for these labels (0 when never set)."""
        with self.lock:
            return self.values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        with self.lock:
            return [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]

    def render(self) -> str:
        return "\n".join([f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()])


class Counter(Metric):
    """A value that only goes up."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only increases")
        key = self._key(labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self.lock:
            self.values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount


class Histogram(Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help)
        self.bounds = tuple(sorted(buckets)) + (math.inf,)
        self.counts: dict[LabelKey, list[int]] = {}
        self.sums: dict[LabelKey, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            counts = self.counts.setdefault(key, [0] * len(self.bounds))
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    counts[i] += 1
            self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        with self.lock:
            return self.counts.get(self._key(labels), [0] * len(self.bounds))[-1]

    def samples(self) -> list[str]:
        out = []
        with self.lock:
            for key in sorted(self.counts):
                for bound, n in zip(self.bounds, self.counts[key]):
                    out.append(f"{self.name}_bucket{_labels(key, (('le', _number(bound)),))} {n}")
                out.append(f"{self.name}_sum{_labels(key)} {_number(self.sums[key])}")
                out.append(f"{self.name}_count{_labels(key)} {self.counts[key][-1]}")
        return out


class Registry:
    """The server's metrics, rendered together."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(m.render() for m in self.metrics) + "\n"
