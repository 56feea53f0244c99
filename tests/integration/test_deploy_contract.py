"""docs/deploy.md against the code: its sclsd.toml loads with sclsd's config loader, its
manifests use the port and probe paths sclsd-http serves, its endpoint-picker flags name
the metrics of its contract table, and a running sclsd-http exports each of them with
the documented type, one sample labelled with the served model's name."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx2 = pytest.importorskip("httpx2")
yaml = pytest.importorskip("yaml")

from prometheus_client.metrics_core import Metric  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sclsd.config import from_dict, parse_host_port  # noqa: E402
from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import launch  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOC = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()


def contract() -> list[tuple[str, str]]:
    """(metric, type) rows of the contract table."""
    return re.findall(r"^\| \w+ \| `(sclsd:\w+)` \| (gauge|counter|histogram) \|", DOC, re.M)


def manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for block in re.findall(r"```yaml\n(.*?)```", DOC, re.S):
        docs += [d for d in yaml.safe_load_all(block) if d]
    return docs


def _kind(kind: str) -> dict[str, Any]:
    (obj,) = [d for d in manifests() if isinstance(d, dict) and d.get("kind") == kind]
    return obj


def test_the_documented_config_and_manifests_fit_sclsd(tmp_path: Path) -> None:
    raw = tomllib.loads(_kind("ConfigMap")["data"]["sclsd.toml"])
    # The image's model directory, stood in for by one with a config.json.
    (tmp_path / "config.json").write_text("{}")
    raw["model"]["name"] = str(tmp_path)
    cfg = from_dict(raw)
    port = parse_host_port(cfg.http.listen)[1]
    spec = _kind("Deployment")["spec"]["template"]["spec"]
    (http,) = [c for c in spec["containers"] if c["name"] == "sclsd-http"]
    assert http["ports"][0]["containerPort"] == port
    probes = {http[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"/ready", "/health"}
    assert cfg.daemon.socket.startswith("/run/sclsd/") and cfg.daemon.uid_share == 1.0
    assert {m["mountPath"] for m in http["volumeMounts"]} >= {"/run/sclsd", "/etc/sclsd"}
    pool = _kind("InferencePool")["spec"]
    assert pool["targetPorts"] == [{"number": port}]
    assert pool["selector"]["matchLabels"] == _kind("Deployment")["spec"]["selector"]["matchLabels"]
    flags = dict(re.findall(r"--(total-queued-requests-metric|total-running-requests-metric|"
                            r"kv-cache-usage-percentage-metric)=(\S+)", DOC))
    rows = dict(contract())
    assert set(flags.values()) == set(rows) and len(rows) == 3
    assert set(rows.values()) == {"gauge"}


@pytest.fixture(scope="module")
def scraped() -> Iterator[dict[str, Metric]]:
    d = launch({"model": {"name": "fake"}, "workers": {"engine": "fake", "spawn": 1, "threads": 1},
                "http": {"model_name": "served-name"}}, wait_workers=1, timeout=120)
    try:
        proc, url = start_http(d.sock, d.status_sock)
        try:
            for path in ("/health", "/ready"):
                assert httpx2.get(url + path, timeout=30).status_code == 200, path
            text = httpx2.get(url + "/metrics", timeout=30).text
            yield {f.name: f for f in text_string_to_metric_families(text)}
        finally:
            assert stop_http(proc) == 0
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("name,kind", contract())
def test_sclsd_http_exports_the_contract(scraped: dict[str, Metric], name: str, kind: str) -> None:
    fam = scraped.get(name)
    assert fam is not None and fam.type == kind, sorted(scraped)
    # One value per box, as the endpoint picker reads it, named after the model it serves.
    (sample,) = fam.samples
    assert sample.labels == {"model_name": "served-name"}
    assert sample.value >= 0 and (name != "sclsd:kv_cache_usage_perc" or sample.value <= 1)
