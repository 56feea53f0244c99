"""Past one box: two sclsd boxes (a daemon with the fake engine and its sclsd-http each)
behind vllm-router, the Rust router of vLLM's production stack, with its ``cache_aware``
and ``power_of_two`` policies. Chat (plain and streamed) and completions go through it;
every answer must be the one a box gives directly, and both boxes must have served.
The router adds its own fields to every body (``no_stop_trim``, ``separate_reasoning``,
...): sclsd-http serves them. ``power_of_two`` polls each box's ``/get_load``."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

httpx2 = pytest.importorskip("httpx2")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sclsd.http.process import start_http, stop_http  # noqa: E402
from sclsd.launch import DaemonProcess, launch  # noqa: E402

# Installed beside this Python (the test extra), or on the PATH.
ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the test extra)")

CHATS = [f"{word} question number {i}: why is the sky blue?"
         for i, word in enumerate(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot"))]
PROMPTS = [f"{word} once upon a time {i}" for i, word in enumerate(("golf", "hotel", "india", "juliet"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def boxes() -> Iterator[list[tuple[DaemonProcess, str]]]:
    """Two boxes: (daemon, its sclsd-http URL) each."""
    started: list[tuple[DaemonProcess, Any, str]] = []
    try:
        for _ in range(2):
            d = launch({"model": {"name": "fake"}, "workers": {"engine": "fake", "spawn": 1, "threads": 1},
                        "scheduler": {"slice_len": 8}}, wait_workers=1, timeout=120)
            proc, url = start_http(d.sock, d.status_sock)
            started.append((d, proc, url))
        yield [(d, url) for d, _, url in started]
    finally:
        for d, proc, _ in started:
            assert stop_http(proc) == 0
            assert d.stop() == 0


def _served(url: str) -> dict[str, float]:
    """A box's sclsd-http answers by route (status 200)."""
    text = httpx2.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "sclsd:http_requests":
            for s in fam.samples:
                if s.name.endswith("_total") and s.labels["status"] == "200":
                    out[s.labels["route"]] = out.get(s.labels["route"], 0) + s.value
    return out


def _start_router(policy: str, urls: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    assert ROUTER is not None
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *urls, "--worker-startup-check-interval", "2"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx2.get(router + "/v1/models", timeout=2).status_code == 200:
                return proc, router
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise AssertionError(f"vllm-router did not start:\n{log.read_text()[-4000:]}")


def _chat(base: str, content: str, stream: bool = False) -> str:
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, "stream": stream}
    r = httpx2.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        return str(choice["message"]["content"])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])


def _completion(base: str, prompt: str) -> str:
    r = httpx2.post(base + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 10,
                                                    "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two"])
def test_two_boxes_behind_vllm_router(boxes: list[tuple[DaemonProcess, str]], policy: str,
                                      tmp_path: Path) -> None:
    urls = [url for _, url in boxes]
    # What each box answers directly (both run the same fake model, so either would do).
    want_chat = {c: _chat(urls[0], c) for c in CHATS}
    want_text = {p: _completion(urls[1], p) for p in PROMPTS}
    assert all(want_chat.values()) and all(want_text.values())
    before = [_served(u) for u in urls]
    proc, router = _start_router(policy, urls, tmp_path / "router.log")
    try:
        # Concurrent, as clients come: the router's own in-flight counts then spread them too.
        with ThreadPoolExecutor(8) as pool:
            chats = list(pool.map(lambda c: _chat(router, c), CHATS))
            streams = list(pool.map(lambda c: _chat(router, c, stream=True), CHATS))
            texts = list(pool.map(lambda p: _completion(router, p), PROMPTS))
        assert chats == [want_chat[c] for c in CHATS]
        assert streams == [want_chat[c] for c in CHATS]
        assert texts == [want_text[p] for p in PROMPTS]
        after = [_served(u) for u in urls]
        gen = ("/v1/chat/completions", "/v1/completions")
        served = [sum(a.get(r, 0) - b.get(r, 0) for r in gen) for a, b in zip(after, before, strict=True)]
        assert sum(served) == 2 * len(CHATS) + len(PROMPTS), served
        assert all(n > 0 for n in served), f"one box served all: {served}"
        if policy == "power_of_two":
            # The router asked each box for its load, and got it.
            assert all(a.get("/get_load", 0) > b.get("/get_load", 0) for a, b in zip(after, before, strict=True))
        # Nothing the router sent was unknown to sclsd-http.
        for url in urls:
            assert "sclsd:http_ignored_parameters_total{" not in httpx2.get(url + "/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"{policy}: requests per box {served}")


HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (Debian's haproxy)")
def test_two_boxes_behind_haproxy_as_docs_deploy_configures_it(boxes: list[tuple[DaemonProcess, str]],
                                                                tmp_path: Path) -> None:
    """docs/deploy.md's haproxy config, its addresses replaced by the boxes' and a free port:
    least connections with /ready as the health check; streams pass through."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    (cfg,) = re.findall(r"```haproxy\n(.*?)```", doc, re.S)
    port = _free_port()
    hosts = iter(url.removeprefix("http://") for _, url in boxes)
    cfg = re.sub(r"(server \w+ )\S+", lambda m: m.group(1) + next(hosts), cfg)
    cfg = cfg.replace("bind :8080", f"bind 127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in cfg and "box1:8000" not in cfg
    (tmp_path / "haproxy.cfg").write_text(cfg)
    assert HAPROXY is not None
    check = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = tmp_path / "haproxy.log"
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    lb = f"http://127.0.0.1:{port}"
    try:
        urls = [url for _, url in boxes]
        want = {c: _chat(urls[0], c) for c in CHATS}
        before = [_served(u) for u in urls]
        deadline = time.monotonic() + 30
        while True:  # until its first health checks passed
            try:
                if httpx2.get(lb + "/ready", timeout=2).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        with ThreadPoolExecutor(8) as pool:
            chats = list(pool.map(lambda c: _chat(lb, c), CHATS))
            streams = list(pool.map(lambda c: _chat(lb, c, stream=True), CHATS))
        assert chats == streams == [want[c] for c in CHATS]
        after = [_served(u) for u in urls]
        served = [a.get("/v1/chat/completions", 0) - b.get("/v1/chat/completions", 0)
                  for a, b in zip(after, before, strict=True)]
        assert sum(served) == 2 * len(CHATS) and all(n > 0 for n in served), served
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"haproxy: requests per box {served}")
