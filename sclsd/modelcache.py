"""On-disk cache of what is slow to derive from a GGUF file: its dequantised weights and
its converted tokenizer, built once and then loaded in well under a second.

transformers dequantises a GGUF's tensors and converts its tokenizer on every load
(SmolLM2-135M: 13-25 s of weights and 3-8 s of tokenizer on two CPU cores). The
first process to need one of them builds it and stores it as an ordinary
transformers directory (``model.safetensors`` + ``config.json``, or
``tokenizer.json`` + ``tokenizer_config.json``); every later load reads that.

Layout, under the cache root (``[model] cache_dir``, ``sclsd-worker --cache-dir``
or ``$SCLSD_CACHE_DIR``; by default systemd's ``$CACHE_DIRECTORY`` or
``$STATE_DIRECTORY/cache`` under a unit that has one, else ``$XDG_CACHE_HOME/sclsd``,
else ``~/.cache/sclsd``)::

    gguf/<sha256 of the GGUF file>/v<FORMAT>-transformers-<version>/model/
    gguf/<sha256 of the GGUF file>/v<FORMAT>-transformers-<version>/tokenizer/

The key is the SHA-256 of the whole file (about 0.1 s for 100 MB; computed once
per process and file), so a changed or replaced file never meets a stale entry,
and the transformers version is part of the path because its converters change.

Entries are written atomically: built in a temporary directory beside the entry
and renamed into place, so a reader sees a complete entry or none. Builders of
the same entry take a file lock, so workers starting together dequantise once and
the others wait for the result; a builder that loses a race anyway discards its
copy. Standard library only: importing this module is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("sclsd.models")

#: Environment variable naming the cache root (set by ``sclsd-worker --cache-dir``).
CACHE_ENV = "SCLSD_CACHE_DIR"
#: Bumped when what an entry holds changes; old entries are then ignored.
FORMAT = 1
#: Temporary build directories older than this are leftovers of a killed builder.
_STALE_TMP_S = 24 * 3600


def default_root() -> Path:
    """Under systemd, the unit's ``CacheDirectory=`` (``$CACHE_DIRECTORY``) or
    ``StateDirectory=`` + ``/cache`` (``sclsd.service`` hides home directories); else
    ``$XDG_CACHE_HOME/sclsd``, else ``~/.cache/sclsd``."""
    env = os.environ
    # systemd separates several directories of one kind with ":"; the first is ours.
    if env.get("CACHE_DIRECTORY"):
        return Path(env["CACHE_DIRECTORY"].split(":")[0])
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0]) / "cache"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sclsd"


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The cache root in effect: ``explicit``, else ``$SCLSD_CACHE_DIR``, else :func:`default_root`."""
    chosen = explicit or os.environ.get(CACHE_ENV)
    return Path(chosen).expanduser() if chosen else default_root()


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    # size, mtime and inode are part of the memo's key only: a file rewritten in
    # place while this process runs is hashed again.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_key(path: Path) -> str:
    """SHA-256 (hex) of the whole file at ``path``, computed once per process and version."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def entry_dir(gguf: Path, part: str, root: Path) -> Path:
    """Where ``part`` (``model`` or ``tokenizer``) of ``gguf`` is cached under ``root``."""
    return root / "gguf" / file_key(gguf) / f"v{FORMAT}-transformers-{_transformers_version()}" / part


@contextlib.contextmanager
def build_lock(dest: Path) -> Iterator[None]:
    """Hold the lock of entry ``dest`` (blocking): one builder at a time. The kernel drops
    it if the holder dies, so a killed builder never blocks the next start."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest.parent / f".{dest.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def publish(dest: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` on a new temporary directory beside ``dest``, flush it to disk and
    rename it to ``dest``; returns ``dest``. Raises what ``build`` or the file system raised
    (the temporary directory is removed)."""
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, dest.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
    try:
        build(tmp)
        # Data first, then the name: after a crash the entry is whole or absent.
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # Another process published first (without our lock: another host on a
            # shared cache, say); its copy is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def discard(dest: Path) -> None:
    """Remove a damaged entry: renamed away first (atomically), so no reader meets it half gone."""
    grave = dest.parent / f".{dest.name}.bad-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(dest, grave)
    except OSError:
        return  # already gone (another process discarded it)
    shutil.rmtree(grave, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(parent: Path, name: str) -> None:
    """Temporary directories of builders killed mid-way (``.NAME.tmp-*``, a day old)."""
    now = time.time()
    for p in parent.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
