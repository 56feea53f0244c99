"""Another local user cannot redirect what the daemon opens in its run directory: a link
planted at a lock file's name is refused (the file it points at is untouched), and a run
directory another user owns or may write to is refused before anything is made in it,
in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sclsd.daemon.errors import StartupError
from sclsd.daemon.lock import DaemonLock, EndpointLocks, check_run_dir

OTHER = 12345  # a uid that is not ours (nor root)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _private(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    return d


def test_a_link_planted_at_the_lock_file_is_refused_and_not_followed(tmp_path: Path) -> None:
    run = _private(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    (run / "sclsd.sock.lock").symlink_to(victim)
    with pytest.raises(StartupError) as ei:
        DaemonLock(str(run / "sclsd.sock.lock"), str(run / "sclsd.sock")).acquire()
    assert "symbolic link" in str(ei.value) and "\n" not in str(ei.value)
    assert victim.read_text() == "secret\n" and (victim.stat().st_mode & 0o777) == 0o600


def test_a_hard_link_or_a_fifo_at_the_lock_file_is_refused(tmp_path: Path) -> None:
    run = _private(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    os.link(victim, run / "a.lock")
    with pytest.raises(StartupError, match="not a plain file"):
        DaemonLock(str(run / "a.lock")).acquire()
    assert victim.read_text() == "secret\n"
    os.mkfifo(run / "b.lock")
    with pytest.raises(StartupError, match="not a plain file"):
        DaemonLock(str(run / "b.lock")).acquire()


def test_a_private_run_directory_is_accepted_and_the_lock_holds_our_pid(tmp_path: Path) -> None:
    run = _private(tmp_path)
    lock = DaemonLock(str(run / "sclsd.sock.lock"))
    lock.acquire()
    try:
        assert (run / "sclsd.sock.lock").read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_a_run_directory_others_may_write_to_is_refused(tmp_path: Path) -> None:
    run = _private(tmp_path)
    for mode in (0o777, 0o1777, 0o775):
        run.chmod(mode)
        with pytest.raises(StartupError) as ei:
            EndpointLocks([(str(run / "sclsd.sock"), str(run / "sclsd.sock.lock"))]).acquire()
        assert "writable by" in str(ei.value) and str(run) in str(ei.value)
        assert not (run / "sclsd.sock.lock").exists(), "nothing is made there"


def test_a_directory_above_it_others_may_write_to_is_refused_unless_sticky(tmp_path: Path) -> None:
    above = tmp_path / "above"
    above.mkdir()
    run = above / "run"
    run.mkdir(mode=0o755)
    above.chmod(0o777)  # anyone could rename "run" away and put their own there
    with pytest.raises(StartupError, match="above the run directory"):
        check_run_dir(str(run))
    above.chmod(0o1777)  # /tmp: only an entry's owner may rename it
    check_run_dir(str(run))


@root_only
def test_a_run_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    # The README's `mkdir -p /tmp/sclsd`, made first by someone else, sticky and all.
    for mode in (0o755, 0o1777):
        run = tmp_path / f"theirs-{mode:o}"
        run.mkdir()
        run.chmod(mode)
        os.chown(run, OTHER, OTHER)
        with pytest.raises(StartupError) as ei:
            DaemonLock(str(run / "sclsd.sock.lock")).acquire()
        assert f"owned by uid {OTHER}" in str(ei.value) and "\n" not in str(ei.value)
        assert not (run / "sclsd.sock.lock").exists()


@root_only
def test_a_link_to_the_run_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    run = _private(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(run)
    os.lchown(link, OTHER, OTHER)  # they could point it elsewhere at any time
    with pytest.raises(StartupError, match=f"owned by uid {OTHER}"):
        check_run_dir(str(link))
    os.lchown(link, os.geteuid(), os.getegid())
    check_run_dir(str(link))


def test_a_run_directory_is_made_one_level_deep_at_most(tmp_path: Path) -> None:
    check_run_dir(str(tmp_path / "run"))  # its parent exists: made
    assert (tmp_path / "run").is_dir()
    with pytest.raises(StartupError) as ei:
        check_run_dir(str(tmp_path / "no" / "such" / "dir"))
    assert "does not exist" in str(ei.value) and not (tmp_path / "no").exists()


def test_an_existing_worker_secret_file_must_be_a_private_hex_secret(tmp_path: Path) -> None:
    from sclsd.daemon.secret import WorkerSecret

    from .conftest import make_config

    secret = tmp_path / "worker.secret"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")  # a config naming /etc/passwd
    secret.chmod(0o644)
    cfg = make_config(tmp_path, daemon={"worker_secret_file": str(secret)})
    with pytest.raises(StartupError, match="chmod 600"):
        WorkerSecret.for_config(cfg, str(tmp_path), curve=False)
    secret.chmod(0o600)
    with pytest.raises(StartupError, match="one hex string"):
        WorkerSecret.for_config(cfg, str(tmp_path), curve=False)
    secret.write_text("00c0ffee\n")
    assert WorkerSecret.for_config(cfg, str(tmp_path), curve=False).value == "00c0ffee"
