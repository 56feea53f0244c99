"""Reading the daemon's Prometheus exposition back in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sclsd.daemon.server import Server

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: Server) -> Samples:
    """Every sample of the daemon's exposition: (name, labels) -> value."""
    out: Samples = {}
    for fam in text_string_to_metric_families(server.metrics.exposition()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample ``name`` with ``labels`` (``model_name`` not needed); 0 when absent."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items()
             if n == name and {(k, x) for k, x in ls if k != "model_name"} == want]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0
