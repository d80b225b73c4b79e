"""Reading Prometheus text: the only importer of ``prometheus_client.parser``.

A vLLM page is about 50 KB of which the adapters need five lines, so only the sample lines of
the wanted metrics are handed to the parser. Everything else on the page, malformed or not, is
none of our business and costs one ``str.startswith`` per line.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ._errors import (
    AmbiguousMetricError,
    MetricsParseError,
    MissingMetricError,
    SnapshotValidationError,
)

__all__ = ["Sample", "finite", "parse_samples", "select_one"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One Prometheus sample: a metric name, its labels and its value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_samples(
    text: str, names: Collection[str], *, url: str | None = None
) -> dict[str, list[Sample]]:
    """Return the samples of ``names`` found in ``text``, keyed by sample name.

    Names are matched exactly (``vllm:num_requests_waiting`` does not take
    ``vllm:num_requests_waiting_by_reason``). A wanted name with no sample maps to ``[]``.

    Raises:
        MetricsParseError: a line of a wanted metric does not parse.
    """
    wanted = frozenset(names)
    prefixes = tuple(wanted)
    kept = [
        line
        for line in text.splitlines()
        if line.startswith(prefixes) and _sample_name(line) in wanted
    ]
    found: dict[str, list[Sample]] = {name: [] for name in wanted}
    if not kept:
        return found
    try:
        # The parser is a generator that raises while it is consumed: consume it in here.
        for family in list(text_string_to_metric_families("\n".join(kept) + "\n")):
            for s in family.samples:
                found[s.name].append(Sample(s.name, s.labels, float(s.value)))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise MetricsParseError(f"cannot parse the metrics exposition: {exc}", url=url) from exc
    return found


def select_one(
    samples: Mapping[str, list[Sample]], name: str, selector: Mapping[str, str]
) -> Sample:
    """The single sample of ``name`` whose labels include every item of ``selector``.

    Raises:
        MissingMetricError: no sample matches.
        AmbiguousMetricError: several samples match; their label sets are named.
    """
    every = samples.get(name, [])
    matching = [s for s in every if _matches(s.labels, selector)]
    if not matching:
        raise MissingMetricError(name, selector=selector, seen=[s.labels for s in every])
    if len(matching) > 1:
        raise AmbiguousMetricError(name, selector=selector, seen=[s.labels for s in matching])
    return matching[0]


def finite(sample: Sample, *, low: float | None = 0.0, high: float | None = None) -> float:
    """The sample's value, refused when it is not a finite number within [low, high]."""
    v = sample.value
    if not math.isfinite(v) or (low is not None and v < low) or (high is not None and v > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise SnapshotValidationError(
            f"metric {sample.name} has value {v}, outside {bounds}", metric=sample.name
        )
    return v


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _sample_name(line: str) -> str:
    end = len(line)
    for sep in ("{", " ", "\t"):
        i = line.find(sep)
        if i != -1 and i < end:
            end = i
    return line[:end]
