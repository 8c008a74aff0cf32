"""Prometheus samples as a dict, for the tests of ``/metrics`` and the instrumented backend."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def metric_samples(text: str) -> dict[SampleKey, float]:
    """{(sample name, its (label, value) pairs sorted): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(base_url: str) -> dict[SampleKey, float]:
    """``metric_samples`` of ``GET base_url/metrics`` (10 s timeout; raises httpx.HTTPError)."""
    return metric_samples(httpx.get(base_url + "/metrics", timeout=10).text)
