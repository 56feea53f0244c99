"""The README's examples, run as written against the built-in model, and the requests
popular clients send by default answered in the right shape by the default config
(scls-cb on hf-cb, SmolLM2-135M-Instruct).

The first shell block of "Using it" runs line by line (a line ending in ``&`` in the
background) with three changes only: its ``/tmp/sclsd`` is a temporary directory,
``.venv/bin/`` is this interpreter's, and ``sclsd-http`` listens on a free port. The
Python examples (saved under the name the README gives and run with the command it
gives) and the HTTP examples (curl, the openai SDK, and the load generators' commands
where the tool is installed) run against what it started. Then, on the same
processes: the requests instructor (TOOLS), pydantic-ai (its default output) and
langchain (``bind_tools``, function calling) record in
``tests/data/tool-clients.json``, log-probabilities, seeds and the Responses API. At
the end the README's stop line runs as written, its job numbers (``%N``) the process
ids of the block's background lines in order, and both processes must exit with 0. A
135M model's answers may be poor; their shape must be right and the schema enforced.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")
httpx2 = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from .test_http_tool_clients import CLIENTS, check_call, cut, sse  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
BIN = str(Path(sys.executable).parent) + "/"
MODEL = "smollm2-135m-instruct"


def section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@dataclass
class Ran:
    """What the shell block started and printed."""

    run_dir: Path
    url: str = ""
    out: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)


def as_here(line: str, run_dir: Path) -> str:
    """A README line as it runs here (the three changes of the module docstring)."""
    return (line.replace("/tmp/sclsd", str(run_dir)).replace(".venv/bin/", BIN)
            .replace("--listen 127.0.0.1:8000", "--listen 127.0.0.1:0"))


def command(line: str) -> tuple[str, bool]:
    """(the command without its comment, whether it runs in the background)."""
    code = line.split("   #")[0].strip()
    background = code.endswith("&")
    return code.rstrip("&").strip(), background


def stop_command(line: str, r: Ran) -> str:
    """The README's stop line as it runs here: job ``%N`` is the Nth background line's process."""
    code, _ = command(as_here(line, r.run_dir))
    return re.sub(r"%(\d+)", lambda m: str(r.procs[int(m[1]) - 1].pid), code)


def wait_listening(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for text in proc.stdout:
        if text.startswith("sclsd-http listening on "):
            return text.split()[3]
        assert time.monotonic() < deadline, "sclsd-http did not listen in time"
    raise AssertionError(f"sclsd-http exited with {proc.wait()}")


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ran]:
    sh, stop = blocks(section("Using it"), "sh")
    (stop_line,) = stop.strip().splitlines()
    assert stop_line.startswith("kill %"), stop_line
    r = Ran(tmp_path_factory.mktemp("readme") / "sclsd")
    stopped: subprocess.CompletedProcess[str] | None = None
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = open(r.run_dir.parent / "daemon.log", "w")  # noqa: SIM115 - closed at teardown
    try:
        for line in sh.strip().splitlines():
            code, background = command(as_here(line, r.run_dir))
            if background and "sclsd-http" in code:
                p = subprocess.Popen(shlex.split(code), cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                r.procs.append(p)
                r.url = wait_listening(p)
                # Its further output is not read: a pipe it fills would block it.
                p.stdout.close()  # type: ignore[union-attr]
            elif background:
                r.procs.append(subprocess.Popen(shlex.split(code), cwd=ROOT, env=env, text=True,
                                                stdout=log, stderr=subprocess.STDOUT))
            else:
                done = subprocess.run(["bash", "-o", "pipefail", "-c", code], cwd=ROOT, env=env, text=True,
                                      capture_output=True, timeout=300)
                # `| head` may close the pipe early: the README's own way of reading a part.
                ok = done.returncode == 0 or ("| head" in code and done.returncode == 141)
                assert ok, f"{line}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}\n" + (
                    (r.run_dir.parent / "daemon.log").read_text()[-4000:])
                r.out[line] = done.stdout
        yield r
        assert len(r.procs) == stop_line.count("%")  # every job the README started, it stops
        stopped = subprocess.run(["bash", "-c", stop_command(stop_line, r)], text=True, capture_output=True,
                                 timeout=60)
    finally:
        if stopped is None:  # the block failed before the end: stop what it started
            for p in reversed(r.procs):
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in reversed(r.procs)]
        log.close()
    assert stopped.returncode == 0, (stop_line, stopped.stderr)
    assert codes == [0] * len(codes), (codes, (r.run_dir.parent / "daemon.log").read_text()[-4000:])


def output(r: Ran, fragment: str) -> str:
    (text,) = [v for k, v in r.out.items() if fragment in k]
    return text


def test_the_shell_example_runs_as_written(ran: Ran) -> None:
    assert output(ran, "wait-ready").startswith("ready: 2/2 workers registered")
    assert output(ran, "submit --stream").strip()
    assert "over 6 tokens, perplexity " in output(ran, "--prompt-logprobs")  # 7 prompt tokens, the first has none
    assert f"model={MODEL}" in output(ran, "status") and "policy=scls-cb" in output(ran, "status")
    assert "tokens/s" in output(ran, "top") or "/s" in output(ran, "top")
    assert output(ran, "metrics").startswith("# ")
    assert "w1: drained" in output(ran, "drain w1 --wait")
    assert "w1: active" in output(ran, "--resume")
    tok = output(ran, "tokenizer").strip()
    assert Path(tok, "tokenizer.json").is_file()
    assert f"tokenizer={tok}" in output(ran, "status")


HTTP = "OpenAI-compatible HTTP (`sclsd-http`)"


def test_the_python_examples_run_as_written(ran: Ran, tmp_path: Path) -> None:
    """Each saved under the README's name and run with the README's command (the venv's python:
    sclsd and the openai SDK are installed there, not in the system's Python)."""
    examples = 0
    for title in ("Using it", HTTP):
        text = section(title)
        runs = re.findall(r"`(\.venv/bin/python (\w+\.py))`", text)
        codes = blocks(text, "python")
        assert len(runs) == len(codes) == 1, (title, runs)
        for (run, name), code in zip(runs, codes, strict=True):
            (tmp_path / name).write_text(as_here(code, ran.run_dir).replace("http://127.0.0.1:8000", ran.url))
            done = subprocess.run(["bash", "-c", as_here(run, ran.run_dir)], cwd=tmp_path, text=True,
                                  capture_output=True, timeout=300)
            assert done.returncode == 0 and done.stdout.strip(), (run, code, done.stdout, done.stderr)
            examples += 1
    assert examples == 2


def test_the_curl_example_runs_as_written(ran: Ran) -> None:
    (curl,) = [b for b in blocks(section(HTTP), "sh") if b.startswith("curl ")]
    code = curl.replace("http://127.0.0.1:8000", ran.url)
    done = subprocess.run(["bash", "-c", code], text=True, capture_output=True, timeout=300)
    reply = json.loads(done.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"], reply


def load_generator(tool: str) -> str:
    """The executable of ``tool`` (``$SCLSD_TEST_<TOOL>``, else on ``PATH``); skips without it:
    neither is a dependency of sclsd (each brings its own torch), the README says how to install."""
    found = os.environ.get(f"SCLSD_TEST_{tool.upper()}") or shutil.which(tool)
    if not found:
        pytest.skip(f"{tool} not installed (set $SCLSD_TEST_{tool.upper()} to its executable)")
    return found


def run_load_generator(ran: Ran, tool: str, tmp_path: Path, env: dict[str, str]) -> None:
    (block,) = [b for b in blocks(section(HTTP), "sh") if b.startswith(f"{tool} ")]
    code = as_here(block, ran.run_dir).replace("http://127.0.0.1:8000", ran.url)
    code = load_generator(tool) + code.removeprefix(tool)
    done = subprocess.run(["bash", "-c", code], cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, (code, done.stdout[-4000:], done.stderr[-4000:])


def test_the_guidellm_command_runs_as_written(ran: Ran, tmp_path: Path) -> None:
    run_load_generator(ran, "guidellm", tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1"})
    (bench,) = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (8, 0, 0), totals


def test_the_aiperf_command_runs_as_written(ran: Ran, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run_load_generator(ran, "aiperf", tmp_path, env)
    (records,) = tmp_path.glob("artifacts/*/profile_export.jsonl")
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    assert len(rows) == 8 and not any(r.get("error") for r in rows), rows
    # --osl 32 is max_completion_tokens (aiperf sends no ignore_eos: an answer may end sooner).
    assert all(1 <= r["metrics"]["usage_completion_tokens"]["value"] <= 32 for r in rows), rows


def test_a_wrong_socket_path_is_named_by_the_python_client(ran: Ran) -> None:
    from sclsd.client import Client

    wrong = str(ran.run_dir / "nope.sock")
    with pytest.raises(OSError, match=re.escape(wrong)):
        Client(wrong)


# ------------------------------------------------------------------ clients' default modes


def replay(url: str, req: dict[str, Any]) -> tuple[dict[str, Any], httpx2.Response]:
    body = {**req["body"], "model": MODEL}
    return body, httpx2.post(url + req["path"], json=body, timeout=300)


def test_the_tool_clients_recorded_requests_on_the_built_in_model(ran: Ran) -> None:
    """instructor TOOLS / TOOLS_STRICT, pydantic-ai's default, langchain's bind_tools and
    function calling, as recorded (``max_tokens`` included), answered at once."""
    with ThreadPoolExecutor(len(CLIENTS["requests"])) as pool:
        answers = list(pool.map(lambda req: replay(ran.url, req), CLIENTS["requests"]))
    for req, (body, r) in zip(CLIENTS["requests"], answers, strict=True):
        assert r.status_code == 200, (req["name"], r.text)
        forced = body.get("tool_choice") not in (None, "auto")
        if not body.get("stream"):
            choice = r.json()["choices"][0]
            message = choice["message"]
            if forced and choice["finish_reason"] == "length":
                cut(message, body)
            elif forced:
                assert choice["finish_reason"] == "tool_calls", (req["name"], choice)
                assert message["tool_calls"], req["name"]
                for call in message["tool_calls"]:
                    check_call(call, body)
            elif choice["finish_reason"] == "tool_calls":  # auto: the model chose to call
                for call in message["tool_calls"]:
                    check_call(call, body)
            else:
                assert message["content"], (req["name"], choice)
            continue
        events = sse(r.text)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if e != "[DONE]")
        chunks = [e for e in events[:-1] if e["choices"]]
        calls: dict[int, dict[str, Any]] = {}
        for c in chunks:
            for p in c["choices"][0]["delta"].get("tool_calls", []):
                call = calls.setdefault(p["index"], {"id": p.get("id"), "type": p.get("type"),
                                                     "function": {"name": p["function"].get("name"),
                                                                  "arguments": ""}})
                call["function"]["arguments"] += p["function"]["arguments"]
        reason = chunks[-1]["choices"][0]["finish_reason"]
        if reason == "length":
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            cut({"content": content or None, "tool_calls": list(calls.values()) or None}, body)
        else:
            assert reason == "tool_calls" and calls, (req["name"], reason)
            for call in calls.values():
                check_call(call, body)


def test_logprobs_and_seeds_on_the_default_engine(ran: Ran) -> None:
    client = openai.OpenAI(base_url=ran.url + "/v1", api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert content[0].token == r.choices[0].message.content[:len(content[0].token)]  # type: ignore[index]
    streamed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                              logprobs=True, top_logprobs=2, stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert [t.token for t in tokens] == [t.token for t in content]

    def sampled(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,  # type: ignore[arg-type]
                                              temperature=1.0, seed=seed).choices[0].message.content or ""

    with ThreadPoolExecutor(4) as pool:
        a, b, c, d = pool.map(sampled, [7, 7, 7, 8])
    assert a == b == c and a, (a, b, c)
    assert d != a  # another seed, another sample (16 tokens at temperature 1)
    shown = subprocess.run([BIN + "sclsctl", "--run-dir", str(ran.run_dir), "submit", "Hi", "--max-tokens", "4",
                            "--logprobs", "2"], text=True, capture_output=True, timeout=300)
    # One line per token: the token, its log-probability and two alternatives.
    rows = [line for line in shown.stdout.splitlines() if re.search(r"-?\d+\.\d{4}\s+'.*':-?\d+\.\d{3}  '", line)]
    assert shown.returncode == 0 and 1 <= len(rows) <= 4, shown.stdout


def test_the_responses_api_on_the_built_in_model(ran: Ran) -> None:
    client = openai.OpenAI(base_url=ran.url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Why is the sky blue?",
                                max_output_tokens=16)
    assert r.object == "response" and r.output_text and r.usage.output_tokens <= 16  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 20}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="What color is the sky? Answer in JSON.",
                                max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "sky", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"color"}
