"""Who may connect and what they may do: socket modes and group, SO_PEERCRED logging and
allow-lists, admin-only messages, a read-only status socket, CURVE on tcp://, no pickle."""

from __future__ import annotations

import ast
import asyncio
import grp
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sclsd import protocol as P
from sclsd.client import Client, RequestError
from sclsd.defaults import offline_env

from .opshelp import REPO, start, stop, wait_for
from .rawclient import Raw

ROOT = os.geteuid() == 0
NOBODY = 65534


def _other_group() -> grp.struct_group | None:
    """A group that is not ours and that we may give files to."""
    if ROOT:
        return next((g for g in grp.getgrall() if g.gr_gid not in (0, os.getgid())), None)
    mine = [g for g in os.getgroups() if g != os.getgid()]
    return grp.getgrgid(mine[0]) if mine else None


GROUP = _other_group()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start(tmp_path_factory.mktemp("sec"),
              daemon={"socket_mode": "0660", "socket_group": GROUP.gr_name if GROUP else "",
                      "allowed_uids": [os.getuid(), NOBODY], "admin_uids": [NOBODY], "log_level": "info"})
    yield d
    assert stop(d) == 0, d.log_text()


def test_sockets_have_mode_0660_and_the_configured_group(daemon) -> None:
    # The worker endpoint is no client interface: daemon.worker_socket_mode, 0600 by default.
    modes = {daemon.sock: 0o660, daemon.status_sock: 0o660, daemon.endpoint[len("ipc://"):]: 0o600}
    for path, mode in modes.items():
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode), path
        assert stat.S_IMODE(st.st_mode) == mode, (path, oct(st.st_mode))
        if GROUP is not None:
            assert st.st_gid == GROUP.gr_gid, path


def test_peer_credentials_are_logged_per_connection(daemon) -> None:
    with Client(daemon.sock, timeout=10) as c:
        c.ping()
    wait_for(lambda: f"pid={os.getpid()} uid={os.getuid()} gid={os.getgid()}" in daemon.log.read_text(), 5,
             "peer credentials in the log", daemon)
    lines = [x for x in daemon.log.read_text().splitlines() if f"pid={os.getpid()} uid=" in x]
    assert any("api conn=" in x and " open " in x for x in lines), lines


def test_admin_messages_need_an_admin_uid(daemon) -> None:
    # admin_uids = [nobody]: not us. Drain and cancelling others' requests are refused...
    with Client(daemon.sock, timeout=10) as c:
        with pytest.raises(RequestError) as ei:
            c.drain_worker("w0")
        assert ei.value.code == "forbidden"
        with pytest.raises(RequestError) as ei:
            c.cancel("someone-elses", any_connection=True)
        assert ei.value.code == "forbidden"
    # ...and nothing changed.
    assert {w.state for w in daemon.status().workers} == {"active"}
    r = subprocess.run([sys.executable, "-m", "sclsd.ctl", "--socket", daemon.sock, "--status-socket",
                        daemon.status_sock, "drain", "w1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "forbidden" in r.stderr


def test_status_socket_is_read_only(daemon) -> None:
    async def run() -> None:
        s = await Raw.open(daemon.status_sock)
        for msg in (P.Generate(prompt="x"), P.Cancel(id="x"), P.DrainWorker(worker="w0"), P.Ping()):
            s.send(msg)
            ev = await s.recv()
            assert isinstance(ev, P.Error) and ev.code == "unknown_type", (msg, ev)
        await s.close()

    asyncio.run(run())
    assert {w.state for w in daemon.status().workers} == {"active"}


def _as_nobody(fn: Callable[[], str]) -> tuple[int, str]:
    """Run ``fn`` in a forked child as uid/gid nobody (no exec: nobody may not be able to read
    the venv); returns (exit status, what it returned or the error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest, no cleanup, just the syscalls and os._exit
        os.close(r)
        code, out = 0, ""
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            code, out = 1, f"{type(exc).__name__}: {exc}"
        os.write(w, out.encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


@pytest.mark.skipif(not ROOT, reason="needs root to run a client as another uid")
def test_a_uid_outside_the_group_cannot_connect(daemon) -> None:
    def connect() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(daemon.sock)
        return "connected"

    code, out = _as_nobody(connect)
    assert code == 1 and out.startswith("PermissionError"), out


def test_allow_list_refuses_other_uids(tmp_path) -> None:
    # Open to every local user: the allow-list (only nobody) decides.
    d = start(tmp_path, daemon={"socket_open_to_all_users": True, "allowed_uids": [NOBODY]}, workers={"spawn": 1})
    try:
        if os.getuid() != NOBODY:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(d.sock)
                # The refusal comes at connect time, unasked: sending first would race the close.
                from .test_fuzz_daemon import _recv_frame

                ev = P.server_decoder.decode(_recv_frame(s) or b"")
                assert isinstance(ev, P.Error) and ev.code == "forbidden"
                assert _recv_frame(s) is None  # disconnected
            assert f"refused: uid {os.getuid()} not in the allow-list" in d.log.read_text()
            assert d.status().workers  # the status socket has its own (empty) list
        if ROOT:
            # nobody is allowed, but is no admin (default admins: root and the daemon's uid).
            def use() -> str:
                with Client(d.sock, timeout=30) as c:
                    reason = c.complete(prompt_ids=[5, 6], max_tokens=3, ignore_eos=True).finish_reason
                    try:
                        c.drain_worker("w0")
                        return f"{reason} drained"
                    except RequestError as e:
                        return f"{reason} {e.code}"

            code, out = _as_nobody(use)
            assert (code, out) == (0, "length forbidden")
    finally:
        stop(d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_requires_curve_keys_in_the_config(tmp_path) -> None:
    from sclsd import config as C

    p = tmp_path / "c.toml"
    p.write_text('[daemon]\nworker_endpoint = "tcp://127.0.0.1:5555"\n')
    with pytest.raises(C.ConfigError) as ei:
        C.load(p)
    assert ei.value.key == "daemon.curve_keypair_file"


def test_workers_on_tcp_authenticate_with_curve(tmp_path) -> None:
    keys = tmp_path / "keys"
    r = subprocess.run([sys.executable, "-m", "sclsd.ctl", "keygen", str(keys), "--worker", "ext"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE((keys / "daemon.keypair").stat().st_mode) == 0o600
    assert stat.S_IMODE((keys / "worker-ext.keypair").stat().st_mode) == 0o600
    from sclsd.keys import generate_keypair, read_authorized_keys, read_keypair, write_keypair

    assert read_keypair(keys / "worker-ext.keypair")[0] in read_authorized_keys(keys / "authorized_workers")
    rogue_pub, rogue_sec = generate_keypair()
    write_keypair(tmp_path / "rogue.keypair", rogue_pub, rogue_sec)

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    d = start(tmp_path, daemon={"worker_endpoint": endpoint, "log_level": "info",
                                "curve_keypair_file": str(keys / "daemon.keypair"),
                                "curve_authorized_keys": str(keys / "authorized_workers")},
              workers={"spawn": 1})  # w0: spawned, with a key pair made for this run
    procs: list[subprocess.Popen[bytes]] = []

    def worker(wid: str, *curve: str) -> None:
        with open(tmp_path / f"{wid}.log", "wb") as out:  # the worker keeps its own descriptor
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "worker.main", "--connect", endpoint, "--id", wid, "--engine", "fake",
                 "--register-retry", "0.5", *curve],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=offline_env()))

    try:
        worker("ext", "--curve-server-key-file", str(keys / "daemon.public"),
               "--curve-keypair", str(keys / "worker-ext.keypair"))
        worker("rogue", "--curve-server-key-file", str(keys / "daemon.public"),
               "--curve-keypair", str(tmp_path / "rogue.keypair"))
        worker("plain")  # no CURVE at all
        wait_for(lambda: {w.id for w in d.status().workers} >= {"w0", "ext"}, 60, "w0 and ext", d)
        wait_for(lambda: f"CURVE key {rogue_pub} is not in" in d.log.read_text(), 30, "rogue refused", d)
        # The daemon dropped the plain worker at the CURVE handshake, before any message of
        # its could arrive (and the rogue's key was refused above): neither can register.
        wait_for(lambda: "daemon disconnected" in (tmp_path / "plain.log").read_text(), 30,
                 "plain worker refused at the handshake", d)
        assert {w.id for w in d.status().workers} == {"w0", "ext"}
        with Client(d.sock, timeout=30) as c:
            for i in range(6):
                done = c.complete(prompt_ids=[3 + i, 4], max_tokens=4, ignore_eos=True)
                assert done.finish_reason == "length"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        rc = stop(d)
    assert rc == 0
    assert "CURVE, " in d.log.read_text()


# --------------------------------------------------------------------------- no pickle

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
FORBIDDEN_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def test_no_pickle_anywhere() -> None:
    offenders: list[str] = []
    for path in sorted([*(REPO / "sclsd").rglob("*.py"), *(REPO / "worker").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if FORBIDDEN_MODULES & set(names):
                offenders.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
                offenders.append(f"{path}:{node.lineno} uses {node.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                kw = {k.arg: k.value for k in node.keywords}
                if node.func.attr == "load" and isinstance(node.func.value, ast.Name) \
                        and node.func.value.id == "torch":
                    w = kw.get("weights_only")
                    if not (isinstance(w, ast.Constant) and w.value is True):
                        offenders.append(f"{path}:{node.lineno} torch.load without weights_only=True")
                a = kw.get("allow_pickle")
                if isinstance(a, ast.Constant) and a.value is True:
                    offenders.append(f"{path}:{node.lineno} allow_pickle=True")
    assert not offenders, offenders
    assert Path(REPO / "sclsd" / "protocol" / "codec.py").read_text().count("msgspec.msgpack") > 0
