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


def directives(name: str) -> dict[str, list[str]]:
    """The [Service] settings of a unit file: key -> values in order (comments skipped)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


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


# What both units set (docs/operations.md, Hardening).
HARDENING = {
    "NoNewPrivileges": ["yes"], "CapabilityBoundingSet": [""], "AmbientCapabilities": [""],
    "ProtectSystem": ["strict"], "ProtectHome": ["yes"], "PrivateTmp": ["yes"], "PrivateMounts": ["yes"],
    "ProtectProc": ["invisible"], "ProtectKernelTunables": ["yes"], "ProtectKernelModules": ["yes"],
    "ProtectKernelLogs": ["yes"], "ProtectControlGroups": ["yes"], "ProtectClock": ["yes"],
    "ProtectHostname": ["yes"], "RestrictNamespaces": ["yes"], "RestrictRealtime": ["yes"],
    "RestrictSUIDSGID": ["yes"], "LockPersonality": ["yes"], "RemoveIPC": ["yes"],
    "SystemCallArchitectures": ["native"], "SystemCallErrorNumber": ["EPERM"],
    "PrivateNetwork": ["yes"], "RestrictAddressFamilies": ["AF_UNIX"], "IPAddressDeny": ["any"],
}


@pytest.mark.parametrize("name", ["sclsd.service", "sclsd-worker@.service"])
def test_units_are_hardened(name: str) -> None:
    d = directives(name)
    for key, values in HARDENING.items():
        assert d.get(key) == values, (key, d.get(key))
    # An allow list first (@system-service), then ~@privileged taken out of it.
    assert d["SystemCallFilter"][:2] == ["@system-service", "~@privileged"], d["SystemCallFilter"]
    # torch (oneDNN JIT) and ctypes callbacks need writable+executable memory; torch reads
    # /proc/cpuinfo for its CPU kernels: neither may be switched on.
    assert "MemoryDenyWriteExecute" not in d and "ProcSubset" not in d
    # Type=notify, the watchdog and the rest stay as they were.
    assert d.get("User") == ["sclsd"] and d.get("Restart") == ["on-failure"]


def test_daemon_and_worker_differ_where_they_must() -> None:
    daemon, worker = directives("sclsd.service"), directives("sclsd-worker@.service")
    assert daemon["Type"] == ["notify"] and daemon["WatchdogSec"] and daemon["NotifyAccess"] == ["main"]
    assert daemon["RuntimeDirectory"] == ["sclsd"] and "RuntimeDirectory" not in worker
    # The daemon: no devices; its sockets are group-shared; socket_group needs chown().
    assert daemon["PrivateDevices"] == ["yes"]
    assert daemon["UMask"] == ["0007"]
    assert daemon["SystemCallFilter"] == ["@system-service", "~@privileged", "@chown"]
    # The worker: the GPUs stay visible (the allow-list is documented, commented out),
    # and its files are private.
    assert "PrivateDevices" not in worker and "DevicePolicy" not in worker and "DeviceAllow" not in worker
    text = (UNITS / "sclsd-worker@.service").read_text()
    for line in ("#DevicePolicy=closed", "#DeviceAllow=/dev/nvidiactl rw", "#DeviceAllow=/dev/nvidia%i rw",
                 "#DeviceAllow=/dev/nvidia-uvm rw", "#DeviceAllow=/dev/nvidia-uvm-tools rw"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert worker["UMask"] == ["0077"]
    assert worker["SystemCallFilter"] == ["@system-service", "~@privileged"]
    assert worker["ReadWritePaths"] == ["-/run/sclsd"]
    # Both manage /var/lib/sclsd: the same mode, whichever starts last.
    assert daemon["StateDirectory"] == worker["StateDirectory"] == ["sclsd"]
    assert daemon["StateDirectoryMode"] == worker["StateDirectoryMode"] == ["0750"]


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


def _security_offline() -> bool:
    if shutil.which("systemd-analyze") is None:
        return False
    r = subprocess.run(["systemd-analyze", "security", "--help"], capture_output=True, text=True, timeout=60)
    return "--offline" in r.stdout


@pytest.mark.skipif(not _security_offline(), reason="systemd-analyze security --offline not available")
def test_systemd_analyze_security_rates_units_ok(tmp_path) -> None:
    # 0.6 and 0.8 SAFE with systemd 252 (5.6 MEDIUM without the hardening); 2.0 leaves room
    # for the checks other systemd versions add.
    shutil.copy(UNITS / "sclsd.service", tmp_path / "sclsd.service")
    shutil.copy(UNITS / "sclsd-worker@.service", tmp_path / "sclsd-worker@0.service")
    for name in ("sclsd.service", "sclsd-worker@0.service"):
        r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=20", "--no-pager", name],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", r.stdout + r.stderr)
        assert m, r.stdout + r.stderr
        assert float(m.group(1)) <= 2.0 and r.returncode == 0, f"{name}: {m.group(0)}\n{r.stdout}"


def _make_install_files(dest, group: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "install-files", f"DESTDIR={dest}", f"SCLSD_GROUP={group}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def _sources(root) -> set[str]:
    return {str(p.relative_to(root)) for d in ("sclsd", "worker") for p in (root / d).rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_install_files_puts_everything_in_place(tmp_path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    r = _make_install_files(tmp_path, group)
    assert r.returncode == 0, r.stderr

    def mode(p: str) -> int:
        return stat.S_IMODE((tmp_path / p).stat().st_mode)

    assert mode("etc/sclsd/sclsd.toml") == 0o640 and mode("etc/sclsd") == 0o750
    assert mode("etc/systemd/system/sclsd.service") == 0o644
    assert (tmp_path / "etc/systemd/system/sclsd-worker@.service").is_file()
    assert _sources(tmp_path / "opt/sclsd") == _sources(REPO)
    assert (tmp_path / "opt/sclsd/worker/main.py").is_file()
    assert (tmp_path / "opt/sclsd/docs/operations.md").is_file()
    assert not list((tmp_path / "opt/sclsd").rglob("__pycache__"))
    # An operator's edited config survives a reinstall.
    (tmp_path / "etc/sclsd/sclsd.toml").write_text("# mine\n")
    r = _make_install_files(tmp_path, group)
    assert r.returncode == 0 and (tmp_path / "etc/sclsd/sclsd.toml").read_text() == "# mine\n"


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_install_files_stages_without_the_group(tmp_path) -> None:
    """CI and containers have no group sclsd: staging still works, the files keep the stager's group."""
    import grp

    missing = "sclsd-no-such-group"
    with pytest.raises(KeyError):
        grp.getgrnam(missing)
    r = _make_install_files(tmp_path, missing)
    assert r.returncode == 0, r.stdout + r.stderr

    def st(p: str) -> os.stat_result:
        return (tmp_path / p).stat()

    for p, m in (("etc/sclsd", 0o750), ("etc/sclsd/keys", 0o750), ("etc/sclsd/sclsd.toml", 0o640),
                 ("etc/systemd/system/sclsd.service", 0o644), ("etc/systemd/system/sclsd-worker@.service", 0o644)):
        assert stat.S_IMODE(st(p).st_mode) == m, p
    assert st("etc/sclsd/sclsd.toml").st_gid == os.getegid()
    assert (tmp_path / "etc/sclsd/sclsd.toml").read_text() == (REPO / "etc/sclsd.toml").read_text()
    assert (tmp_path / "etc/systemd/system/sclsd.service").read_text() == (UNITS / "sclsd.service").read_text()
    assert _sources(tmp_path / "opt/sclsd") == _sources(REPO)
    assert (tmp_path / "opt/sclsd/docs/operations.md").is_file()
