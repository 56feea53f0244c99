"""Operations: the status snapshot, sclsctl status/top, Prometheus metrics (status socket
and HTTP) and logs with one line per event and request ids in every line."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sclsd import protocol as P
from sclsd.client import Client, status

from .opshelp import start, stop, wait_for
from .rawclient import Raw

N = 30


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start(tmp_path_factory.mktemp("ops"), daemon={"metrics_http": "127.0.0.1:0", "log_level": "info"},
              options={"decode_s": 0.001})

    async def load() -> None:
        c = await Raw.open(d.sock)
        for i in range(N):
            c.send(P.Generate(id=f"o{i}", prompt_ids=[3 + i, 4, 5], max_tokens=4 + i % 20, ignore_eos=True))
        await c.until_terminal({f"o{i}" for i in range(N)})
        await c.close()

    asyncio.run(load())
    yield d
    assert stop(d) == 0, d.log_text()


def _ctl(d, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sclsd.ctl", "--socket", d.sock, "--status-socket",
                           d.status_sock, *args], capture_output=True, text=True, timeout=60)


def test_status_snapshot_has_the_documented_fields(daemon) -> None:
    st = daemon.status()
    assert isinstance(st, P.StatusSnapshot)  # typed: the decoder checked every field
    assert st.version and st.protocol == P.PROTOCOL_VERSION and st.serving and not st.draining
    assert {w.id for w in st.workers} == {"w0", "w1"}
    for w in st.workers:
        assert w.engine == "fake" and w.state == "active" and 0 <= w.heartbeat_age_s < 5 and w.pid > 0
    assert sum(w.tokens_done for w in st.workers) == sum(4 + i % 20 for i in range(N))
    assert st.counters["finished"] >= N and st.estimator_error.batches > 0
    assert st.pool_size == 0 and st.queued_tokens == 0


def test_sclsctl_status_table_and_json(daemon) -> None:
    r = _ctl(daemon, "status")
    assert r.returncode == 0, r.stderr
    assert "policy=scls" in r.stdout and "pool=0" in r.stdout
    rows = [x.split() for x in r.stdout.splitlines() if x.startswith(("w0 ", "w1 "))]
    assert {x[0] for x in rows} == {"w0", "w1"} and all(x[1] == "fake" and x[3] == "active" for x in rows)
    assert "estimator:" in r.stdout and "counters:" in r.stdout
    r = _ctl(daemon, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["workers"]


def test_sclsctl_top_redraws_with_rates(daemon) -> None:
    r = _ctl(daemon, "top", "--iterations", "2", "--interval", "0.2")
    assert r.returncode == 0, r.stderr
    frames = r.stdout.split("--- ")[1:]  # not a tty: frames separated by a time line
    assert len(frames) == 2
    for frame in frames:  # rates from the first frame on
        assert re.search(r"finished=[0-9.]+/s", frame) and re.search(r"tokens=[0-9.]+/s", frame)
    assert "w0" in frames[1] and "w1" in frames[1]


def test_sclsctl_top_first_frame_shows_the_load(daemon) -> None:
    """Issue 20: the first frame showed 0.0/s with requests running."""
    stop = threading.Event()

    def load() -> None:
        with Client(daemon.sock, timeout=30) as c:
            while not stop.is_set():
                c.complete(prompt_ids=[9, 9, 9], max_tokens=40, ignore_eos=True)

    t = threading.Thread(target=load)
    t.start()
    try:
        # Started once the daemon has served some of the load, so it runs during the frame.
        wait_for(lambda: daemon.status().counters.get("finished", 0) > N + 2, 30, "load running", daemon)
        r = _ctl(daemon, "top", "--iterations", "1", "--interval", "1")
    finally:
        stop.set()
        t.join(60)
    assert r.returncode == 0, r.stderr
    rate = re.search(r"tokens=([0-9.]+)/s", r.stdout)
    assert rate and float(rate.group(1)) > 0, r.stdout


EXPECTED = [
    "sclsd:num_requests_waiting", "sclsd:num_requests_running", "sclsd:num_queued_tokens",
    "sclsd:schedule_interval_seconds", "sclsd:num_workers", "sclsd:estimator_abs_error_seconds",
    "sclsd:time_to_first_token_seconds", "sclsd:e2e_request_latency_seconds",
    "sclsd:request_queue_time_seconds", "sclsd:time_per_output_token_seconds",
    "sclsd:request_prompt_tokens", "sclsd:request_generation_tokens", "sclsd:request_success",
    "sclsd:prompt_tokens", "sclsd:generation_tokens", "sclsd:worker_load_seconds",
    "sclsd:worker_queue_depth", "sclsd:worker_heartbeat_age_seconds", "sclsd:worker_state",
    "sclsd:worker_generation_tokens", "sclsd:batch_size",
]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_exposition_on_the_status_socket(daemon) -> None:
    fams = _families(status(daemon.status_sock, metrics=True))
    for name in EXPECTED:
        assert name in fams, name
    assert fams["sclsd:e2e_request_latency_seconds"].type == "histogram"
    count = next(s.value for s in fams["sclsd:e2e_request_latency_seconds"].samples if s.name.endswith("_count"))
    assert count >= N
    success = {s.labels["finished_reason"]: s.value for s in fams["sclsd:request_success"].samples
               if s.name.endswith("_total")}
    assert success["length"] >= N
    workers = {s.labels["worker"] for s in fams["sclsd:worker_load_seconds"].samples}
    assert workers == {"w0", "w1"}
    states = {(s.labels["worker"], s.labels["state"]): s.value for s in fams["sclsd:worker_state"].samples}
    assert states[("w0", "active")] == 1 and states[("w0", "drained")] == 0


def test_prometheus_over_http(daemon) -> None:
    addr = daemon.status().metrics_http
    assert addr and addr.startswith("127.0.0.1:")
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        fams = _families(r.read().decode())
    for name in EXPECTED:
        assert name in fams, name
    with urllib.request.urlopen(f"http://{addr}/metrics?name[]=sclsd:num_workers", timeout=10) as r:
        fams = _families(r.read().decode())
    assert list(fams) == ["sclsd:num_workers"] and fams["sclsd:num_workers"].samples[0].value == 2


def test_metrics_http_is_off_by_default() -> None:
    from sclsd.config import load

    assert load(None).daemon.metrics_http == ""


def test_logs_are_one_line_per_event_with_request_ids(daemon) -> None:
    evil = "evil\nFAKE LOG LINE id=forged"
    with Client(daemon.sock, timeout=30) as c:
        c.complete(id=evil, prompt_ids=[7, 8], max_tokens=2, ignore_eos=True)
        with pytest.raises(Exception):  # noqa: B017 - refused: any RequestError
            c.complete(id="dup-check", prompt_ids=[1] * 5000, max_tokens=1)
    # The lines of both requests are written by the time the log shows the refusal (the
    # later of the two); then the whole log is checked.
    wait_for(lambda: "refused id=dup-check" in daemon.log.read_text(), 10, "the refusal logged", daemon)
    lines = daemon.log.read_text().splitlines()
    assert not any(x.startswith("FAKE LOG LINE") for x in lines)
    # The daemon's ids are the client's scoped to its connection: "<conn>:<client id>".
    assert any(re.search(r"done id=\d+:evil\\nFAKE LOG LINE id=forged", x) for x in lines)
    # Every line about a request names it.
    for x in lines:
        if any(k in x for k in (" done ", " refused ", " cancelled", " timed out", " error id", "accepted ")):
            assert "id=" in x, x
    for i in range(N):
        assert any(re.search(rf"done id=\d+:o{i} reason=length", x) for x in lines), i
    assert any("refused id=dup-check" in x and "prompt_too_long" in x for x in lines)
