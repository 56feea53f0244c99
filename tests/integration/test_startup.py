"""Start-up of a real daemon: it listens at once and answers ``starting`` until it serves,
``sclsctl status`` shows the workers that load, ``sclsctl wait-ready`` waits for them; hub
ids served from a local Hugging Face cache; the default model's conversion cached once."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sclsd import modelcache, models
from sclsd.client import Client
from sclsd.launch import DaemonProcess, launch
from sclsd.protocol import StatusSnapshot

pytest.importorskip("torch")

HUB_REV = "89abcdef0123456789abcdef0123456789abcdef"
WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "why", "is", "the", "sky", "blue", "?", "!"]


def _ctl(d: DaemonProcess, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sclsd.ctl", "--socket", d.sock, "--status-socket",
                           d.status_sock, *args], capture_output=True, text=True, timeout=timeout)


def _snapshot_when(d: DaemonProcess, pred: Any, timeout: float = 60.0) -> StatusSnapshot:
    """The first status snapshot for which ``pred`` holds (the daemon answers from its first
    second on; each round trip is the event waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, d.log_text()
        try:
            st = d.status(timeout=5)
        except OSError:  # the process has not bound its status socket yet
            st = None
        if st is not None and pred(st):
            return st
        time.sleep(0.05)
    raise AssertionError("no such status within the time:\n" + d.log_text())


def test_daemon_answers_starting_then_shows_loading_workers_then_serves(tmp_path: Path) -> None:
    # The daemon builds the tokenizer cache of tiny-random (SmolLM2's, from its GGUF) in an
    # empty cache directory under the entry's lock; holding that lock keeps it starting.
    cache = tmp_path / "cache"
    gguf = models.smollm2_gguf_path()
    entry = modelcache.entry_dir(gguf, "tokenizer", cache)
    sections = {"model": {"name": "tiny-random", "cache_dir": str(cache)},
                "workers": {"spawn": 2, "engine": "hf", "threads": 1},
                "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.05}}
    with modelcache.build_lock(entry):
        d = launch(sections, log=tmp_path / "sclsd.log")
        try:
            st = _snapshot_when(d, lambda s: s.starting)
            assert not st.serving and st.why == "starting: loading the tokenizer of tiny-random"
            r = _ctl(d, "submit", "hello")
            assert r.returncode == 1 and "starting: sclsd is starting (loading the tokenizer" in r.stderr
            r = _ctl(d, "wait-ready", "--timeout", "0.3")
            assert r.returncode == 1
            assert r.stderr.startswith("sclsctl: not ready after 0.3s: starting: loading the tokenizer")
            # The workers load meanwhile; they register with a daemon that is not wired yet,
            # so they stay "loading", each with its latest step.
            st = _snapshot_when(d, lambda s: len(s.loading) == 2
                                and all("registering with the daemon" in w.step for w in s.loading))
            assert st.starting and [w.id for w in st.loading] == ["w0", "w1"]
            assert all(w.pid > 0 and w.age_s >= 0 for w in st.loading)
            table = _ctl(d, "status").stdout
            assert "STARTING: starting: loading the tokenizer of tiny-random" in table
            assert sum(line.startswith(("w0 ", "w1 ")) and " loading " in line for line in table.splitlines()) == 2
        except BaseException:
            d.stop(timeout=10)
            raise
    try:
        r = _ctl(d, "wait-ready", "--workers", "2", "--timeout", "120")
        assert r.returncode == 0 and r.stdout == "ready: 2/2 workers registered\n", r.stderr + d.log_text()
        st = d.status()
        assert st.serving and not st.starting and st.loading == [] and len(st.workers) == 2
        with Client(d.sock, timeout=60) as c:
            done = c.complete(prompt="hello", max_tokens=4, temperature=0.0)
        assert done.usage.completion_tokens >= 1
        assert (entry / "tokenizer.json").is_file()  # built once the lock was free
    finally:
        assert d.stop() == 0, d.log_text()


def test_sigterm_during_start_up_stops_the_daemon_at_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    entry = modelcache.entry_dir(models.smollm2_gguf_path(), "tokenizer", cache)
    sections = {"model": {"name": "tiny-random", "cache_dir": str(cache)},
                "workers": {"spawn": 1, "engine": "hf", "threads": 1}, "scheduler": {"policy": "scls"}}
    with modelcache.build_lock(entry):  # the daemon's tokenizer load waits on it, for ever
        d = launch(sections, log=tmp_path / "sclsd.log")
        try:
            st = _snapshot_when(d, lambda s: s.starting and len(s.loading) == 1)
            worker_pid = st.loading[0].pid
            d.proc.terminate()
            assert d.proc.wait(timeout=30) == 0, d.log_text()
        finally:
            d.stop(timeout=10)
    assert "stopped by SIGTERM during start-up" in d.log_text()
    assert not Path(d.sock).exists() and not Path(d.status_sock).exists()
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # reaped by the daemon before it exited; gone at once or nearly
            os.kill(worker_pid, 0)
            time.sleep(0.05)


def _hub_model(cache: Path, repo_id: str) -> Path:
    """A tiny Llama (tiny-random's architecture, a 12-word vocabulary) with a tokenizer, laid
    out as the Hugging Face cache holds a downloaded repository."""
    import torch
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / HUB_REV
    snap.mkdir(parents=True)
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(snap)
    torch.manual_seed(0)
    config = LlamaConfig(**{**models.TINY_RANDOM_CONFIG, "vocab_size": len(WORDS)})
    LlamaForCausalLM(config).save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REV)
    return snap


def test_daemon_serves_a_hub_id_from_the_local_cache_offline(tmp_path: Path) -> None:
    _hub_model(tmp_path / "hub", "acme/tiny-chat")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    with launch({"model": {"name": "acme/tiny-chat"}, "workers": {"spawn": 1, "engine": "hf", "threads": 1},
                 "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.05}},
                log=tmp_path / "sclsd.log", env=env, wait_workers=1, timeout=120) as d:
        st = d.status()
        assert st.model == "acme/tiny-chat" and st.workers[0].model == "acme/tiny-chat"
        with Client(d.sock, timeout=60) as c:
            done = c.complete(messages=[{"role": "user", "content": "why is the sky blue ?"}],
                              max_tokens=6, temperature=0.0, ignore_eos=True)
        assert done.usage.prompt_tokens == 6 and done.usage.completion_tokens == 6
        assert set(done.text.split()) <= set(WORDS)


@pytest.mark.slow  # converts the default model's tokenizer (a few seconds)
def test_default_tokenizer_from_the_cache_equals_the_converted_one(tmp_path: Path) -> None:
    gguf = models.smollm2_gguf_path()
    fresh = models._convert_gguf_tokenizer(gguf)
    entry = modelcache.publish(modelcache.entry_dir(gguf, "tokenizer", tmp_path), fresh.save_pretrained)
    cached = models._load_saved_tokenizer(entry)
    assert cached.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert (cached.all_special_ids, cached.chat_template, cached.eos_token_id, len(cached)) == (
        fresh.all_special_ids, fresh.chat_template, fresh.eos_token_id, len(fresh))
    chat = [{"role": "user", "content": "héllo wörld 日本語 🤖"}]
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == \
        fresh.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    for text in ["Hello, world!", "<|im_start|>user\nhi<|im_end|>", "  spaces\n\ttabs"]:
        assert cached.encode(text) == fresh.encode(text)


@pytest.mark.slow  # two daemon starts with two workers on the default model, a GGUF load (about 60 s)
def test_default_model_is_converted_once_and_the_second_start_reads_the_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first start dequantises the GGUF once for both workers, the second reads the cache,
    and what the cache holds is the GGUF's model, weights, logits and config."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    sections = {"model": {"name": "smollm2-135m-instruct", "cache_dir": str(cache)},
                "workers": {"spawn": 2, "engine": "hf", "threads": 1}, "scheduler": {"policy": "scls"}}
    ms = models.resolve("default")
    assert ms.path is not None and ms.gguf_file is not None
    # The reference, transformers reading the GGUF itself, loads on the core the conversion
    # leaves idle (one worker converts, the other waits for it): half a minute saved.
    reference = concurrent.futures.ThreadPoolExecutor(1)
    direct_model = reference.submit(AutoModelForCausalLM.from_pretrained, str(ms.path), gguf_file=ms.gguf_file,
                                    local_files_only=True, dtype=torch.float32)
    reference.shutdown(wait=False)
    took = []
    for run in ("first", "second"):
        t0 = time.monotonic()
        with launch(sections, log=tmp_path / f"{run}.log", wait_workers=2, timeout=300):
            took.append(time.monotonic() - t0)
        log = (tmp_path / f"{run}.log").read_text()
        built = log.count("building the model cache")
        assert built == (1 if run == "first" else 0), log  # two workers, one conversion
        assert log.count("dequantising its weights") == built, log
        assert log.count("loading the model of SmolLM2-135M-Instruct.Q4_1.gguf from the cache") == 2
    print(f"ready with 2 workers: first start {took[0]:.1f}s, second start {took[1]:.1f}s")
    assert took[1] < took[0]

    caplog.set_level(logging.INFO, "sclsd.models")
    cached = models.load_model(ms, cache_dir=cache)
    assert "dequantising" not in caplog.text and "loading the model of" in caplog.text
    direct = direct_model.result(timeout=300)
    want, got = direct.state_dict(), cached.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356]])
    with torch.no_grad():
        assert torch.equal(cached(ids).logits, direct(ids).logits)

    def facts(config: Any) -> dict[str, Any]:
        return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "quantization_config")}

    # The cached entry's config is the GGUF's, less the quantisation the weights no longer have.
    assert facts(cached.config) == facts(direct.config)
