"""Hugging Face hub ids, resolved from the local Hugging Face cache; downloads on request.

A model spec such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` names a repository
of the hub. sclsd never downloads unless the operator says so (``[model]
allow_download = true``): the spec is looked up in the local cache, laid out as
huggingface_hub lays it out::

    <cache>/models--ORG--NAME/refs/main          the commit the snapshot of "main" is
    <cache>/models--ORG--NAME/snapshots/<commit>/ config.json, *.safetensors, tokenizer...

The lookup reads that layout itself (no huggingface_hub import, which would also
freeze the cache location at import time). Standard library only.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from .defaults import OFFLINE_ENV

log = logging.getLogger("sclsd.models")

#: A hub repository id: ``NAME`` or ``ORG/NAME`` (letters, digits, ``-_.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
#: Files :func:`download` fetches: weights as safetensors, configs, tokenizers, templates.
PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` has the shape of a hub id (it may still name a local path)."""
    return bool(_HUB_ID.fullmatch(spec)) and ".." not in spec and not spec.endswith(".gguf")


def cache_dir() -> Path:
    """The hub cache, by huggingface_hub's rules: ``$HF_HUB_CACHE`` (or the older
    ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
    else ``~/.cache/huggingface/hub``. Read at each call."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The local snapshot directory of hub model ``repo_id``, or None if it is not cached.

    ``refs/main`` names the snapshot; a repository fetched at one other revision only
    has that one snapshot, which is then taken.
    """
    repo = (cache or cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        return snap if snap.is_dir() else None
    snaps = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    return snaps[0] if len(snaps) == 1 else None


def download(repo_id: str, timeout: float | None = None) -> None:
    """Download the :data:`PATTERNS` files of hub model ``repo_id`` into :func:`cache_dir`.

    Runs ``huggingface_hub.snapshot_download`` in a child process with the network
    allowed: huggingface_hub reads the offline switch when it is imported, and the
    calling process stays offline. ``ValueError`` with the downloader's last words if
    it fails or takes longer than ``timeout`` seconds.
    """
    log.info("downloading %s into %s", repo_id, cache_dir())
    code = ("import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(sys.argv[1], allow_patterns=sys.argv[2:])")
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV or k == "TOKENIZERS_PARALLELISM"}
    try:
        out = subprocess.run([sys.executable, "-c", code, repo_id, *PATTERNS], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ValueError(f"downloading {repo_id!r} took longer than {timeout:.0f}s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise ValueError(f"cannot download {repo_id!r}: {last}")
