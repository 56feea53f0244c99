"""ZeroMQ CURVE key files for workers on ``tcp://`` (written by ``sclsctl keygen``).

Formats (plain text, Z85-encoded 32-byte keys, 40 characters each):

* a **key pair** file holds the public key and the secret key, one a line
  (mode 0600). The daemon reads its own from ``daemon.curve_keypair_file``; a
  worker reads its own with ``sclsd-worker --curve-keypair FILE``;
* a **public key** file holds one public key (``daemon.public``: give it to
  workers with ``--curve-server-key-file``);
* the **authorized keys** file (``daemon.curve_authorized_keys``) lists the
  public keys of the workers allowed to connect, one a line (anything after
  the key, such as the worker's name, is ignored); lines starting with ``# ``
  are comments.
"""

from __future__ import annotations

import os
from pathlib import Path

KEY_CHARS = 40
_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _check_key(text: str, what: str) -> bytes:
    if len(text) != KEY_CHARS or not set(text) <= _Z85:
        raise ValueError(f"{what}: not a Z85 CURVE key ({KEY_CHARS} characters)")
    return text.encode("ascii")


def generate_keypair() -> tuple[str, str]:
    """A fresh (public, secret) CURVE key pair, Z85 text."""
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def write_keypair(path: str | Path, public: str, secret: str) -> None:
    """Write a key pair file readable by its owner only; never overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{public}\n{secret}\n")


def read_keypair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a key pair file; refuses one that others may read."""
    p = Path(path)
    if p.stat().st_mode & 0o007:
        raise ValueError(f"{p}: a secret key file must not be accessible to others (chmod 0600)")
    parts = p.read_text().split()
    if len(parts) != 2:
        raise ValueError(f"{p}: expected a public and a secret key, one a line")
    return _check_key(parts[0], f"{p} public key"), _check_key(parts[1], f"{p} secret key")


def read_public_key(path: str | Path) -> bytes:
    """The single public key of a public key file (the first token)."""
    parts = Path(path).read_text().split()
    if not parts:
        raise ValueError(f"{path}: empty")
    return _check_key(parts[0], f"{path}")


def read_authorized_keys(path: str | Path) -> set[bytes]:
    """Public keys of the authorized workers: one a line, ``#`` comments."""
    keys: set[bytes] = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        tokens = line.split()
        # "#" is a Z85 character, so a comment is "#" alone or "# " and text, never a key.
        if not tokens or tokens[0] == "#" or line.lstrip().startswith("# "):
            continue
        keys.add(_check_key(tokens[0], f"{path}:{n}"))
    return keys


def keygen(directory: str | Path, workers: list[str]) -> list[Path]:
    """Create the daemon's key pair (once) and one key pair per named worker.

    Returns the files written. Existing key pairs are kept, so running it again
    with a new worker name only adds that worker.
    """
    d = Path(directory)
    d.mkdir(mode=0o750, parents=True, exist_ok=True)
    written: list[Path] = []
    daemon = d / "daemon.keypair"
    if not daemon.exists():
        public, _secret = generate_keypair()
        write_keypair(daemon, public, _secret)
        written.append(daemon)
    public = read_keypair(daemon)[0].decode()
    pub_file = d / "daemon.public"
    if not pub_file.exists() or pub_file.read_text().split()[:1] != [public]:
        pub_file.write_text(public + "\n")
        pub_file.chmod(0o644)
        written.append(pub_file)
    auth = d / "authorized_workers"
    known = read_authorized_keys(auth) if auth.exists() else set()
    for name in workers:
        if not name or any(c in name for c in "/\\\n\0") or name.startswith("."):
            raise ValueError(f"bad worker name {name!r}")
        pair = d / f"worker-{name}.keypair"
        if not pair.exists():
            wpub, wsec = generate_keypair()
            write_keypair(pair, wpub, wsec)
            written.append(pair)
        wpub_b = read_keypair(pair)[0]
        if wpub_b not in known:
            with open(auth, "a") as f:
                f.write(f"{wpub_b.decode()} {name}\n")
            known.add(wpub_b)
            if auth not in written:
                written.append(auth)
    if auth.exists():
        auth.chmod(0o644)
    return written
