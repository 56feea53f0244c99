"""``sclsd-bench gpu-bundle``: complete an offline bundle with every wheel sclsd imports on a GPU box.

::

    bash ../shared/gpu-kit/prepare.sh .gpu-bundle        # the box's wheels, models and trace
    python3 -m sclsd.bench.cli gpu-bundle .gpu-bundle    # what that list leaves out (make gpu-bundle: both)

A GPU box has Python 3.12 with its own torch stack but no network, so what sclsd needs beyond that
stack travels as wheels (``DEST/whl``), installed with ``--no-deps``. A hand-kept list of wheels
misses what its packages import in turn: a bundle with ``fastapi`` and ``uvicorn`` but without
``annotated-doc``, ``anyio`` or ``httptools`` cannot start ``sclsd-http``. This walks the
requirements instead: from sclsd's own (``uvicorn[standard]`` with its extra), through each
package's metadata in this environment, evaluated for the box (CPython 3.12 on x86-64 Linux),
and downloads, at the versions installed here (the ones the tests ran), each wheel the bundle
lacks. What the box's torch and transformers bring (:data:`BOX_OWN`) is neither followed nor
bundled: those are built against one another there, and a copy beside them would shadow them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

#: The box's interpreter, for the requirements' markers.
BOX_ENV: dict[str, str] = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "implementation_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
}  # fmt: skip

#: Distributions the box's torch stack brings (prepare.sh: torch, transformers, numpy, scipy, msgpack,
#: uvloop, prometheus-client) and what those require: compiled against one another, or shipped by
#: prepare.sh (transformers; prometheus-client in ``whl-extra`` for a box without it), so neither
#: followed nor bundled.
BOX_OWN = frozenset(canonicalize_name(n) for n in (
    "torch", "triton", "numpy", "scipy", "msgpack", "uvloop", "prometheus-client",
    "transformers", "huggingface-hub", "tokenizers", "safetensors",
    "regex", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "filelock", "fsspec", "requests",
    "urllib3", "certifi", "charset-normalizer", "tqdm", "pyyaml", "packaging", "setuptools",
))  # fmt: skip

#: pip's flags for wheels that install on the box (prepare.sh's).
PLATFORM = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--platform", "any"]  # fmt: skip


def _skipped(name: str, own: frozenset[str]) -> bool:
    n = canonicalize_name(name)
    return n in own or n.startswith("nvidia-")


def _applies(marker: Marker | None, extras: Iterable[str], env: dict[str, str]) -> bool:
    if marker is None:
        return True
    return any(marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def closure(roots: Iterable[str], own: frozenset[str] = BOX_OWN,
            env: dict[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    """Every distribution ``roots`` (requirement strings, extras included) need on the box, by
    canonical name, at the version installed here; :data:`BOX_OWN` and ``nvidia-*`` are neither
    followed nor returned. Raises ``LookupError`` naming a requirement not installed here."""
    env = BOX_ENV if env is None else env
    found: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        if _skipped(req.name, own):
            continue
        name = canonicalize_name(req.name)
        seen = extras_seen.setdefault(name, set())
        if name in found and req.extras <= seen:
            continue
        seen |= req.extras
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise LookupError(f"{req.name} is required but not installed here (make venv first)") from None
        found[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub.marker, seen, env):
                todo.append(sub)
    return found


def sclsd_roots(env: dict[str, str] | None = None) -> list[str]:
    """sclsd's own runtime requirements that apply on the box (no optional extras)."""
    env = BOX_ENV if env is None else env
    out = []
    for text in metadata.distribution("sclsd").requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(str(Requirement(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}")))
    return out


def bundled(dest: Path) -> set[str]:
    """The canonical names of the wheels a bundle carries (``whl/`` and ``whl-extra/``)."""
    names = set()
    for sub in ("whl", "whl-extra"):
        for path in (dest / sub).glob("*.whl"):
            try:
                names.add(str(parse_wheel_filename(path.name)[0]))
            except InvalidWheelFilename:
                continue
    return names


def missing(dest: Path, roots: Iterable[str] | None = None) -> dict[str, str]:
    """What :func:`closure` of ``roots`` (sclsd's own by default) needs and ``dest`` lacks."""
    need = closure(sclsd_roots() if roots is None else roots)
    have = bundled(dest)
    return {n: v for n, v in sorted(need.items()) if n not in have}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", type=Path, help="the bundle (prepare.sh's DEST), e.g. .gpu-bundle")
    p.add_argument("--dry-run", action="store_true", help="list what is missing, download nothing")


def run(args: argparse.Namespace) -> int:
    dest: Path = args.dest
    if not (dest / "whl").is_dir():
        print(f"gpu-bundle: {dest}/whl does not exist: build the bundle first "
              f"(bash ../shared/gpu-kit/prepare.sh {dest})", file=sys.stderr)  # fmt: skip
        return 2
    try:
        lack = missing(dest)
    except LookupError as exc:
        print(f"gpu-bundle: {exc}", file=sys.stderr)
        return 2
    if not lack:
        print(f"gpu-bundle: {dest} carries every wheel sclsd needs beyond the box's own stack")
        return 0
    specs = [f"{n}=={v}" for n, v in lack.items()]
    print(f"gpu-bundle: {len(specs)} wheels missing from {dest}: {' '.join(specs)}", flush=True)
    if args.dry_run:
        return 0
    cmd = [sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(dest / "whl"), *specs]
    rc = subprocess.run(cmd).returncode
    if rc:
        print(f"gpu-bundle: pip download failed ({rc})", file=sys.stderr)
        return rc
    print(f"gpu-bundle: added {len(specs)} wheels to {dest / 'whl'}")
    return 0
