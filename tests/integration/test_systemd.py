"""systemd: the notify protocol of a real daemon, journal-ready logs, the units, make install."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time

import pytest

from sclsd.client import Client

from .opshelp import REPO, short_dir, start, stop


def test_daemon_speaks_sd_notify_and_logs_for_the_journal(tmp_path) -> None:
    sdir = short_dir()
    path = str(sdir / "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(path)
    ns.settimeout(60)
    # What systemd sets for Type=notify + WatchdogSec=0.4 under the journal.
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000", "JOURNAL_STREAM": "8:12345"}
    d = start(tmp_path, env=env, wait=False, daemon={"log_level": "info"}, dir=sdir)
    try:
        msg = ns.recv(4096).decode()
        assert msg.startswith("READY=1"), msg
        assert f"STATUS=serving on {d.sock}" in msg
        with Client(d.sock, timeout=10) as c:  # READY means the socket accepts connections
            c.ping()
        pings = 0
        t0 = time.monotonic()
        while pings < 4:
            assert ns.recv(4096) == b"WATCHDOG=1"
            pings += 1
        assert time.monotonic() - t0 < 30
        d.wait_workers(2)
        d.proc.send_signal(signal.SIGTERM)
        while (msg := ns.recv(4096).decode()) == "WATCHDOG=1":
            pass
        assert msg.startswith("STOPPING=1") and "STATUS=draining 0 requests" in msg, msg
        assert d.proc.wait(timeout=60) == 0
    finally:
        ns.close()
        stop(d)
    # Under the journal: a syslog priority prefix, no timestamp (the journal has its own).
    lines = [x for x in d.log.read_text().splitlines() if not x.startswith(("20", "sclsd-worker"))
             and "sclsd-worker[" not in x]
    assert lines
    assert all(re.match(r"<[2-7]>sclsd", x) for x in lines), [x for x in lines if not x.startswith("<")][:5]
    assert any(x.startswith("<6>sclsd: sclsd starting") for x in lines)


UNITS = REPO / "systemd"


def test_units_have_what_operations_need() -> None:
    daemon = (UNITS / "sclsd.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "RuntimeDirectory=sclsd", "StateDirectory=sclsd",
                 "User=sclsd", "Group=sclsd", "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes",
                 "LimitNOFILE=", "KillSignal=SIGTERM", "Restart=on-failure", "NotifyAccess=main"):
        assert re.search(rf"^{re.escape(line)}", daemon, re.M), line
    worker = (UNITS / "sclsd-worker@.service").read_text()
    for line in ("Environment=CUDA_VISIBLE_DEVICES=%i", "Restart=on-failure", "User=sclsd",
                 "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes"):
        assert re.search(rf"^{re.escape(line)}", worker, re.M), line
    assert re.search(r"^ExecStart=.*sclsd-worker .*--id gpu%i", worker, re.M)
    # The stop timeout leaves room for the default drain (30 s).
    assert int(re.search(r"^TimeoutStopSec=(\d+)", daemon, re.M).group(1)) > 30


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path) -> None:
    # verify insists that ExecStart= binaries exist: point them at this checkout's venv.
    bindir = os.path.dirname(os.path.realpath(shutil.which("sclsd") or str(REPO / ".venv/bin/sclsd")))
    for name in ("sclsd.service", "sclsd-worker@.service"):
        text = (UNITS / name).read_text().replace("/opt/sclsd/.venv/bin", bindir)
        (tmp_path / name).write_text(text)
    shutil.copy(tmp_path / "sclsd-worker@.service", tmp_path / "sclsd-worker@0.service")
    r = subprocess.run(["systemd-analyze", "verify", "sclsd.service", "sclsd-worker@0.service"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    ours = [x for x in (r.stdout + r.stderr).splitlines() if "sclsd" in x]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_install_files_puts_everything_in_place(tmp_path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    r = subprocess.run(["make", "-s", "install-files", f"DESTDIR={tmp_path}", f"SCLSD_GROUP={group}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    def mode(p: str) -> int:
        return stat.S_IMODE((tmp_path / p).stat().st_mode)

    assert mode("etc/sclsd/sclsd.toml") == 0o640 and mode("etc/sclsd") == 0o750
    assert mode("etc/systemd/system/sclsd.service") == 0o644
    assert (tmp_path / "etc/systemd/system/sclsd-worker@.service").is_file()
    assert (tmp_path / "opt/sclsd/sclsd/daemon.py").is_file()
    assert (tmp_path / "opt/sclsd/worker/main.py").is_file()
    assert (tmp_path / "opt/sclsd/docs/operations.md").is_file()
    assert not list((tmp_path / "opt/sclsd").rglob("__pycache__"))
    # An operator's edited config survives a reinstall.
    (tmp_path / "etc/sclsd/sclsd.toml").write_text("# mine\n")
    r = subprocess.run(["make", "-s", "install-files", f"DESTDIR={tmp_path}", f"SCLSD_GROUP={group}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "etc/sclsd/sclsd.toml").read_text() == "# mine\n"
