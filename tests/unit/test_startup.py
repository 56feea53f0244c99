"""Start-up: the daemon listens at once and answers ``starting`` until it can serve, spawned
workers show as loading with their latest step, ``sclsctl wait-ready``, the model flags
and keys (``--dtype``, ``--device``, ``[model]``), and the cache of converted models."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sclsd import ctl, modelcache, models
from sclsd import protocol as P
from sclsd.client import AsyncClient, RequestError, status
from sclsd.config import ConfigError, from_dict
from sclsd.daemon import server as server_mod
from sclsd.daemon.errors import StartupError
from sclsd.daemon.server import Server
from sclsd.daemon.supervisor import Supervisor
from sclsd.preflight import check_model
from sclsd.tokenizer import ByteTokenizer
from unit.inproc import InprocTransport
from worker import main as wm
from worker.engines.fake import FakeEngine


def _config(tmp: Path, **sections: dict[str, Any]) -> Any:
    raw: dict[str, dict[str, Any]] = {
        "daemon": {"socket": f"{tmp}/api.sock", "status_socket": f"{tmp}/status.sock",
                   "worker_endpoint": f"ipc://{tmp}/w.ipc"},
        "model": {"name": "fake"},
        # The static policy: the engines these tests name (fake, hf) serve static batches.
        "scheduler": {"policy": "scls", "slice_len": 8, "gamma_s": 0.001},
        "workers": {"spawn": 0, "engine": "fake"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return from_dict(raw)


class GatedLoad:
    """Stands in for ``tokenizers.load``: says when it was called, returns when let go."""

    def __init__(self, result: Any = None) -> None:
        self.called = threading.Event()
        self.go = threading.Event()
        self.result = result if result is not None else ByteTokenizer()

    def __call__(self, spec: str, cache_dir: Any = None) -> Any:
        self.called.set()
        if not self.go.wait(10):
            raise TimeoutError("the test never let the tokenizer load finish")
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# --------------------------------------------------------------------------- the daemon


def test_daemon_listens_at_once_and_answers_starting_until_its_tokenizer_is_ready(tmp_path, monkeypatch):
    gate = GatedLoad()
    monkeypatch.setattr(server_mod.tokenizers, "load", gate)
    cfg = _config(tmp_path)

    async def main() -> None:
        transport = InprocTransport()
        server = Server(cfg, transport=transport)
        start = asyncio.create_task(server.start(sockets=True, spawn=False))
        # start() listens before it loads the tokenizer: once the load began, both sockets answer.
        assert await _in_thread(gate.called.wait, 5)
        st = await _in_thread(status, cfg.daemon.status_socket)
        assert st.starting and not st.serving and st.workers == []
        assert st.why == "starting: loading the tokenizer of fake"
        # A worker that registers now is answered once the daemon is wired, not lost.
        w = transport.connect("w0", FakeEngine(), auth=server.secret or "")
        async with AsyncClient(cfg.daemon.socket) as c:
            assert (await c.ping()).protocol == P.PROTOCOL_VERSION
            with pytest.raises(RequestError) as err:
                await c.complete(prompt="hello", max_tokens=4, temperature=0.0)
            assert err.value.code == "starting" and "wait-ready" in err.value.message
            gate.go.set()
            await start
            done = await c.complete(prompt="hello", max_tokens=4, temperature=0.0)
            assert done.finish_reason in ("stop", "length") and done.worker == "w0"
        assert any(isinstance(m, P.Welcome) for m in w.received)
        st = await _in_thread(status, cfg.daemon.status_socket)
        assert not st.starting and st.serving and [x.id for x in st.workers] == ["w0"]
        await server.stop()
        assert not Path(cfg.daemon.socket).exists() and not Path(cfg.daemon.status_socket).exists()

    asyncio.run(main())


def test_a_tokenizer_that_cannot_load_is_a_startup_error_and_the_sockets_go(tmp_path, monkeypatch):
    gate = GatedLoad(result=OSError("no such file"))
    gate.go.set()
    monkeypatch.setattr(server_mod.tokenizers, "load", gate)
    cfg = _config(tmp_path)

    async def main() -> None:
        server = Server(cfg, transport=InprocTransport())
        with pytest.raises(StartupError, match="cannot load the tokenizer of model 'fake': no such file"):
            await server.start(sockets=True, spawn=False)
        await server.stop()

    asyncio.run(main())
    assert not Path(cfg.daemon.socket).exists() and not Path(cfg.daemon.status_socket).exists()


def test_an_empty_worker_secret_file_stops_the_daemon_before_it_starts(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text("")
    made: list[str] = []
    mkdtemp = server_mod.tempfile.mkdtemp
    monkeypatch.setattr(server_mod.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    with pytest.raises(StartupError, match="is empty"):
        Server(_config(tmp_path, daemon={"worker_secret_file": str(secret)}), transport=InprocTransport())
    assert made and not Path(made[0]).exists()  # its private run directory is gone too


def test_a_download_is_attempted_only_when_allowed(tmp_path, monkeypatch):
    fetched: list[str] = []

    def fetch(name: str) -> None:
        fetched.append(name)
        raise ValueError("offline")

    monkeypatch.setattr(server_mod.models, "fetch", fetch)
    monkeypatch.setattr(server_mod.tokenizers, "load", lambda spec, cache_dir=None: ByteTokenizer())

    async def start(**model: Any) -> None:
        cfg = _config(tmp_path, model=model, workers={"engine": "hf"})
        server = Server(cfg, transport=InprocTransport())
        try:
            await server.start(sockets=False, spawn=False)
        finally:
            await server.stop()

    asyncio.run(start(name="tiny-random"))
    assert fetched == []
    with pytest.raises(StartupError, match="cannot download model 'tiny-random': offline"):
        asyncio.run(start(name="tiny-random", allow_download=True))
    assert fetched == ["tiny-random"]


# --------------------------------------------------------------------------- supervisor


def test_spawned_workers_get_dtype_cache_dir_and_a_progress_file(tmp_path):
    cfg = _config(tmp_path, model={"name": "tiny-random", "dtype": "bfloat16", "cache_dir": str(tmp_path / "c")},
                  workers={"engine": "hf", "device": "cuda", "spawn": 2})
    sup = Supervisor(cfg, str(tmp_path), None, lambda wid: [], on_exit=lambda w, y: None,
                     on_give_up=lambda y: None)
    cmd = sup.command("w1", 1)

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--dtype") == "bfloat16" and flag("--device") == "cuda:1"
    assert flag("--cache-dir") == str(tmp_path / "c")
    assert flag("--progress-file") == str(tmp_path / "w1.progress")
    fake = Supervisor(_config(tmp_path), str(tmp_path), None, lambda wid: [], on_exit=lambda w, y: None,
                      on_give_up=lambda y: None)
    fake_cmd = fake.command("w0", 0)
    assert "--dtype" not in fake_cmd and "--cache-dir" not in fake_cmd  # the fake engine has no weights


def test_workers_options_dtype_still_wins_where_it_agrees(tmp_path):
    cfg = _config(tmp_path, model={"name": "tiny-random"}, workers={"engine": "hf", "options": {"dtype": "float16"}})
    cmd = Supervisor(cfg, str(tmp_path), None, lambda wid: [], on_exit=lambda w, y: None,
                     on_give_up=lambda y: None).command("w0", 0)
    # argparse keeps the last value: the options come after [model] dtype ("auto").
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--dtype"] == ["auto", "float16"]
    with pytest.raises(ConfigError, match="workers.options.dtype = 'float16': conflicts with model.dtype"):
        _config(tmp_path, model={"name": "tiny-random", "dtype": "bfloat16"},
                workers={"engine": "hf", "options": {"dtype": "float16"}})


def test_loading_lists_running_unregistered_workers_with_their_latest_step(tmp_path):
    sup = Supervisor(_config(tmp_path), str(tmp_path), None, lambda wid: [], on_exit=lambda w, y: None,
                     on_give_up=lambda y: None)
    sup.procs = {"w0": SimpleNamespace(pid=10, returncode=None),  # type: ignore[dict-item]
                 "w1": SimpleNamespace(pid=11, returncode=None),
                 "w2": SimpleNamespace(pid=12, returncode=1),  # exited: restarting
                 "w3": SimpleNamespace(pid=13, returncode=1)}  # exited too often: given up
    sup.gave_up = {"w3": "local worker w3 exited 5 times in a row"}
    sup.spawned_at = {"w0": 0.0, "w1": 0.0, "w2": 0.0, "w3": 0.0}
    Path(sup.progress_file("w0")).write_text("reading x.gguf and dequantising its weights\n")
    loading = sup.loading(registered={"w1": object()})
    assert [(w.id, w.pid, w.step, w.state) for w in loading] == [
        ("w0", 10, "reading x.gguf and dequantising its weights", "loading"),
        ("w2", 12, "exited rc=1", "restarting"),
        ("w3", 13, "local worker w3 exited 5 times in a row", "given_up")]
    assert loading[0].age_s > 0
    assert [w.step for w in sup.loading(registered=set()) if w.id == "w1"] == [""]  # no step logged yet


# --------------------------------------------------------------------------- worker


def test_worker_keeps_its_latest_loading_step_in_the_progress_file(tmp_path):
    path = tmp_path / "w0.progress"
    handler = wm.report_progress(path)
    try:
        logging.getLogger("worker").setLevel(logging.INFO)
        logging.getLogger("sclsd.models").setLevel(logging.INFO)
        logging.getLogger("sclsd.models").info("reading %s and dequantising its weights", "x.gguf")
        assert path.read_text() == "reading x.gguf and dequantising its weights\n"
        logging.getLogger("worker").info("engine hf ready")
        assert path.read_text() == "engine hf ready\n"
    finally:
        wm.stop_progress(handler)
    logging.getLogger("sclsd.models").info("after the load")
    assert path.read_text() == "engine hf ready\n"  # detached: the file keeps the last step
    assert wm.report_progress(None) is None


def test_worker_resolves_dtype_auto_and_applies_the_cache_dir(tmp_path, monkeypatch):
    seen: dict[str, Any] = {}

    def create_engine(name: str, model: Any, device: str, **opts: Any) -> str:
        seen.update(name=name, model=model, device=device, opts=opts, cache=os.environ.get(modelcache.CACHE_ENV))
        return "engine"

    monkeypatch.setattr("worker.engines.create_engine", create_engine)
    monkeypatch.delenv(modelcache.CACHE_ENV, raising=False)
    args = wm.build_parser().parse_args(["--connect", "ipc:///x", "--id", "w0", "--model", "tiny-random",
                                         "--dtype", "auto", "--cache-dir", str(tmp_path)])
    try:
        assert wm.load_engine(args) == "engine"
    finally:
        os.environ.pop(modelcache.CACHE_ENV, None)
    assert seen["opts"]["dtype"] == "float32" and seen["cache"] == str(tmp_path)


def test_auto_dtype(tmp_path):
    assert models.auto_dtype("tiny-random", "cpu") == "float32"
    assert models.auto_dtype("tiny-random", "cuda:0") == "bfloat16"
    for declared, want in [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]:
        d = tmp_path / declared
        d.mkdir()
        (d / "config.json").write_text(f'{{"model_type": "llama", "torch_dtype": "{declared}"}}')
        assert models.auto_dtype(str(d), "cuda") == want
        assert models.auto_dtype(str(d), "cpu") == "float32"


# --------------------------------------------------------------------------- sclsctl


def _snapshot(**kw: Any) -> P.StatusSnapshot:
    base: dict[str, Any] = dict(
        version="0", protocol=P.PROTOCOL_VERSION, uptime_s=1.0, draining=False, model="m", policy="scls",
        slice_len=8, interval_s=0.5, pool_size=0, live_requests=0, running_requests=0, admitting=0,
        queued_tokens=0, limits=P.Limits(max_queued_requests=1, max_queued_tokens=1), connections=0,
        metrics_http=None, workers=[], estimator={}, counters={},
        estimator_error=P.EstimatorError(batches=0, mean_error_s=None, mean_abs_error_s=None, last=[]))
    base.update(kw)
    return P.StatusSnapshot(**base)


def _worker(wid: str) -> P.WorkerStatus:
    return P.WorkerStatus(id=wid, engine="hf", model="m", device="cpu", pid=1, state="active", load_s=0.0,
                          batches_inflight=0, queued_batches=0, busy=False, batches_done=0, tokens_done=0,
                          heartbeat_age_s=0.1)


LOADING = [P.LoadingWorker(id="w0", pid=7, age_s=3.0, step="reading x.gguf and dequantising its weights")]


def test_readiness():
    starting = _snapshot(serving=False, starting=True, why="starting: loading the tokenizer of m")
    assert ctl.readiness(starting, 1) == (False, "starting: loading the tokenizer of m; 0/1 workers registered")
    assert ctl.readiness(_snapshot(loading=LOADING), 1) == (
        False, "0/1 workers registered; loading w0: reading x.gguf and dequantising its weights (3s)")
    assert ctl.readiness(_snapshot(workers=[_worker("w0")]), 1)[0] is True
    assert ctl.readiness(_snapshot(workers=[_worker("w0")]), 2)[0] is False
    gave_up = _snapshot(serving=False, why="no workers: w0 exited 5 times")
    assert ctl.readiness(gave_up, 1) == (None, "no workers: w0 exited 5 times")
    assert ctl.readiness(_snapshot(draining=True, workers=[_worker("w0")]), 1)[0] is None


def _wait_ready(monkeypatch, capsys, answers: list[Any], *argv: str) -> tuple[int, str, str]:
    """``sclsctl wait-ready`` against a status socket that gives ``answers`` in turn."""
    calls = iter(answers)

    def fake_status(path: str, timeout: float = 10.0) -> P.StatusSnapshot:
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ctl, "status", fake_status)
    rc = ctl.main(["--status-socket", "/nonexistent", "wait-ready", "--interval", "0", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_wait_ready_waits_through_an_absent_socket_and_start_up(monkeypatch, capsys):
    answers = [FileNotFoundError(2, "No such file or directory"),
               _snapshot(serving=False, starting=True, why="starting: loading the tokenizer of m"),
               _snapshot(loading=LOADING), _snapshot(workers=[_worker("w0")])]
    rc, out, err = _wait_ready(monkeypatch, capsys, answers, "--timeout", "60")
    assert rc == 0 and out == "ready: 1/1 workers registered\n" and err == ""


def test_wait_ready_times_out_saying_what_the_daemon_is_doing(monkeypatch, capsys):
    answers = [_snapshot(loading=LOADING)] * 1000
    rc, out, err = _wait_ready(monkeypatch, capsys, answers, "--timeout", "0.05")
    assert rc == 1 and out == ""
    assert err == ("sclsctl: not ready after 0.05s: 0/1 workers registered; loading w0: reading x.gguf "
                   "and dequantising its weights (3s)\n")


def test_wait_ready_gives_up_at_once_on_a_daemon_that_gave_up(monkeypatch, capsys):
    answers = [_snapshot(serving=False, why="no workers: w0 exited 5 times")]  # asked once only
    rc, _, err = _wait_ready(monkeypatch, capsys, answers, "--timeout", "600")
    assert rc == 1 and err == "sclsctl: not ready and will not be: no workers: w0 exited 5 times\n"


def test_status_table_shows_starting_and_loading_workers():
    text = ctl.format_status(_snapshot(serving=False, starting=True, why="starting: loading the tokenizer of m",
                                       loading=LOADING, workers=[_worker("w1")]))
    assert "STARTING: starting: loading the tokenizer of m" in text and "NOT SERVING" not in text
    w0 = next(line for line in text.splitlines() if line.startswith("w0"))
    assert "loading" in w0 and "pid=7" in w0 and w0.endswith("reading x.gguf and dequantising its weights")


# --------------------------------------------------------------------------- flags and config


def test_dtype_and_device_flags_reach_the_config(monkeypatch):
    from sclsd.daemon import cli

    seen: list[Any] = []

    class FakeServer:
        def __init__(self, cfg: Any) -> None:
            seen.append(cfg)

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(server_mod, "Server", FakeServer)
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)
    assert cli.main(["--model", "tiny-random", "--dtype", "bfloat16", "--device", "cuda"]) == 0
    assert (seen[0].model.dtype, seen[0].workers.device) == ("bfloat16", "cuda")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--dtype", "int8"])


def test_model_keys_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="model.dtype = 'fp8': must be one of auto, float32, bfloat16, float16"):
        _config(tmp_path, model={"dtype": "fp8"})
    with pytest.raises(ConfigError, match="model.allow_download = 'yes': must be of type bool"):
        _config(tmp_path, model={"allow_download": "yes"})
    cfg = _config(tmp_path, model={"name": "tiny-random"}, workers={"engine": "hf"})
    assert (cfg.model.dtype, cfg.model.allow_download, cfg.model.cache_dir) == ("auto", False, "")


def test_check_model_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _config(tmp_path, model={"name": "acme/missing"}, workers={"engine": "hf"})  # load() leaves it
    with pytest.raises(ConfigError) as err:
        check_model(cfg)
    msg = str(err.value)
    assert msg.startswith("config error: model.name = 'acme/missing': model 'acme/missing' is neither")
    assert str(tmp_path / "hub") in msg and "allow_download = true" in msg and "\n" not in msg
    check_model(_config(tmp_path, model={"name": "acme/missing", "allow_download": True}, workers={"engine": "hf"}))
    with pytest.raises(ConfigError, match="unknown model spec 'no model'"):
        check_model(_config(tmp_path, model={"name": "no model"}, workers={"engine": "hf"}))
    check_model(_config(tmp_path))  # fake: nothing to find


def test_sclsd_refuses_an_unknown_model_in_one_line_with_exit_2(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--model", "acme/no-such-model",
                        "--socket", f"{tmp_path}/s.sock"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("sclsd: config error: model.name = 'acme/no-such-model': ")
    assert len(r.stderr.splitlines()) == 1


# --------------------------------------------------------------------------- the model cache


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    for var in (modelcache.CACHE_ENV, "CACHE_DIRECTORY", "STATE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert modelcache.cache_root() == Path.home() / ".cache" / "sclsd"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert modelcache.cache_root() == tmp_path / "xdg" / "sclsd"
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/sclsd")  # systemd's StateDirectory=
    assert modelcache.cache_root() == Path("/var/lib/sclsd/cache")
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/sclsd:/var/cache/other")
    assert modelcache.cache_root() == Path("/var/cache/sclsd")
    monkeypatch.setenv(modelcache.CACHE_ENV, str(tmp_path / "env"))
    assert modelcache.cache_root() == tmp_path / "env"
    assert modelcache.cache_root(tmp_path / "given") == tmp_path / "given"


def test_entries_are_keyed_by_the_file_content(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF one")
    a = modelcache.entry_dir(f, "model", tmp_path / "c")
    assert a.name == "model" and a.parent.parent.name == modelcache.file_key(f)
    f.write_bytes(b"GGUF two, longer")
    b = modelcache.entry_dir(f, "model", tmp_path / "c")
    assert a.parent.parent != b.parent.parent  # another content, another key
    assert modelcache.entry_dir(f, "tokenizer", tmp_path / "c").parent == b.parent  # one key, two parts


def test_publish_is_all_or_nothing(tmp_path):
    dest = tmp_path / "e" / "model"

    def broken(d: Path) -> None:
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        modelcache.publish(dest, broken)
    assert not dest.exists() and os.listdir(dest.parent) == []  # no entry, no leftovers
    modelcache.publish(dest, lambda d: (d / "weights").write_text("1"))
    # A second publisher that lost the race keeps the first entry and leaves nothing behind.
    modelcache.publish(dest, lambda d: (d / "weights").write_text("2"))
    assert (dest / "weights").read_text() == "1" and sorted(os.listdir(dest.parent)) == ["model"]


def test_concurrent_builders_build_once_and_everyone_reads_the_entry(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    builds: list[int] = []

    def build(d: Path) -> None:
        builds.append(1)
        (d / "data").write_text("ok")

    results: list[Any] = []

    def load() -> None:
        results.append(models._cached(gguf, "tokenizer", build, lambda d: (d / "data").read_text(),
                                      tmp_path / "cache"))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["ok"] * 4 and builds == [1]


def test_an_unusable_cache_falls_back_and_a_damaged_entry_is_removed(tmp_path, caplog):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    caplog.set_level(logging.WARNING, "sclsd.models")
    assert models._cached(gguf, "model", lambda d: None, lambda d: "x", not_a_dir) is None
    assert "cannot use the model cache" in caplog.text
    root = tmp_path / "cache"
    entry = modelcache.entry_dir(gguf, "model", root)
    modelcache.publish(entry, lambda d: (d / "data").write_text("truncated"))

    def load(d: Path) -> str:
        raise ValueError("bad safetensors header")

    assert models._cached(gguf, "model", lambda d: None, load, root) is None
    assert "cannot be read (bad safetensors header)" in caplog.text and not entry.exists()


def test_early_messages_hand_over_each_workers_latest_register_in_order():
    from sclsd.daemon.startup import EarlyMessages

    def reg(wid: str, pid: int) -> P.Register:
        return P.Register(worker_id=wid, engine="fake", model="fake", device="cpu", kv_bytes_per_token=1,
                          mem_available=1, pid=pid)

    early = EarlyMessages()
    early.hold(b"a", reg("w0", 1))
    early.hold(b"b", reg("w1", 2))
    early.hold(b"a", reg("w0", 3))  # w0 registered again while the daemon was starting
    got = [(peer, msg.pid) for peer, msg in early.take()]
    assert got == [(b"b", 2), (b"a", 3)]
    assert early.take() == []  # handed over once
