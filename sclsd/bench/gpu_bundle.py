"""The offline bundle a GPU box without network runs on: completed here, installed and checked there.

::

    bash ../shared/gpu-kit/prepare.sh .gpu-bundle        # the box's wheels, models and trace
    python3 -m sclsd.bench.cli gpu-bundle .gpu-bundle    # what that list leaves out (make gpu-bundle: both)

Here (``sclsd-bench gpu-bundle``). A GPU box has Python 3.12 with its own torch stack but no
network, so what sclsd needs beyond that stack travels as wheels (``DEST/whl``), installed with
``--no-deps``. A hand-kept list of wheels misses what its packages import in turn: a bundle with
``fastapi`` and ``uvicorn`` but without ``annotated-doc``, ``anyio`` or ``httptools`` cannot
start ``sclsd-http``. :func:`missing` walks the requirements instead: from sclsd's own
(``uvicorn[standard]`` with its extra), through each package's metadata in this environment,
evaluated for the box (CPython 3.12 on x86-64 Linux), and the wheels the bundle lacks are
downloaded at the versions installed here (the ones the tests ran). What the box's torch and
transformers bring (:data:`BOX_OWN`) is neither followed nor bundled: those are built against
one another there, and a copy beside them would shadow them.

On the box (``gpu-check``'s setup stage): :func:`install` puts the wheels beside the box's torch,
and :func:`unimportable` names each module serving needs that the box still cannot import.
Nothing beyond the standard library is imported at module level: setup runs before the
project's dependencies may be importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.markers import Marker


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it (``Annotated_Doc`` is ``annotated-doc``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


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
BOX_OWN = frozenset(canonical(n) for n in (
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
    n = canonical(name)
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
    from packaging.requirements import Requirement

    env = BOX_ENV if env is None else env
    found: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        if _skipped(req.name, own):
            continue
        name = canonical(req.name)
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
    from packaging.requirements import Requirement

    env = BOX_ENV if env is None else env
    out = []
    for text in metadata.distribution("sclsd").requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else ""))
    return out


def bundled(dest: Path) -> set[str]:
    """The canonical names of the wheels a bundle carries (``whl/`` and ``whl-extra/``)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

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


# --------------------------------------------------------------------------- on the box


#: Modules a box may lack that a bundle's ``whl-extra/`` carries, by their wheel's name.
EXTRA_WHEELS = {"pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "pygments": "pygments",
                "pytest_timeout": "pytest_timeout", "prometheus_client": "prometheus_client",
                "tqdm": "tqdm", "packaging": "packaging"}  # fmt: skip


#: ``scipy.optimize.curve_fit`` for a box without scipy: the estimator fits
#: t = c1·x·y + c2·x + c3·y + c4 with non-negative coefficients, which is small enough
#: to solve exactly by trying every support of the four coefficients.
SCIPY_SHIM = '''"""numpy-only stand-in for scipy.optimize.curve_fit (sclsd-bench gpu-check, no scipy here)."""
import itertools

import numpy as np


class OptimizeWarning(UserWarning):
    pass


def curve_fit(f, xdata, ydata, p0=None, bounds=(-np.inf, np.inf), maxfev=0):
    x, y = np.asarray(xdata, dtype=float)
    t = np.asarray(ydata, dtype=float)
    a = np.column_stack([x * y, x, y, np.ones_like(x)])
    if not np.all(np.asarray(bounds[0]) >= 0):
        return np.linalg.lstsq(a, t, rcond=None)[0], None
    best, best_r = np.zeros(4), float(t @ t)
    for k in range(1, 5):
        for sup in itertools.combinations(range(4), k):
            c = np.linalg.lstsq(a[:, sup], t, rcond=None)[0]
            if np.all(c >= 0):
                p = np.zeros(4)
                p[list(sup)] = c
                r = float(np.sum((a @ p - t) ** 2))
                if r < best_r:
                    best, best_r = p, r
    return best, None
'''


def _pip(target: Path, wheels: list[Path], timeout: float) -> bool:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]  # fmt: skip
    try:
        return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def install(bundle: Path | None, work: Path) -> dict[str, Any]:
    """On the box: ``bundle``'s wheels installed beside the box's own torch (into
    ``WORK/site``; a ``whl-extra`` wheel only where the box lacks its module), a numpy
    ``curve_fit`` where scipy is missing, then :func:`unimportable`. Returns the setup row:
    what was installed, what failed, the ``PYTHONPATH`` the later stages need."""
    paths: list[str] = []
    row: dict[str, Any] = {"phase": "env", "python": sys.executable, "bundle": str(bundle) if bundle else None}
    if bundle:
        site = work / "site"
        wheels = sorted((bundle / "whl").glob("*.whl"))
        failed: list[str] = []
        if wheels and not _pip(site, wheels, 180):
            print("gpu-check setup: installing the wheels together failed; one by one", file=sys.stderr)
            failed = [w.name for w in wheels if not _pip(site, [w], 60)]
        sys.path.insert(0, str(site))
        extra = []
        for mod, wheel in EXTRA_WHEELS.items():
            found = sorted((bundle / "whl-extra").glob(f"{wheel}-*.whl"))
            if importlib.util.find_spec(mod) is None and found:
                if _pip(site, found[:1], 60):
                    extra.append(found[0].name)
                else:
                    failed.append(found[0].name)
        row.update(wheels=len(wheels), extra=extra, failed=failed)
        if site.is_dir():
            paths.append(str(site.resolve()))
    if importlib.util.find_spec("scipy") is None:
        shim = work / "shim" / "scipy"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "__init__.py").write_text('"""stand-in: see optimize.py"""\n__version__ = "0+shim"\n')
        (shim / "optimize.py").write_text(SCIPY_SHIM)
        paths.append(str(shim.parent.resolve()))
        row["scipy_shim"] = True
    row["pythonpath"] = paths
    row["unimportable"] = unimportable(paths)
    return row


#: What serving imports, beyond torch: the daemon, the worker, the GPU engines, sclsd-http and
#: the modules they load only when they start (uvicorn's httptools protocol, uvloop).
SERVING_MODULES = ("zmq", "msgspec", "llguidance", "gguf", "sclsd.daemon.cli", "worker.main",
                   "worker.engines.hf", "worker.engines.hf_cb", "worker.engines.hf_static_cb",
                   "worker.engines.grammar", "sclsd.http.cli", "uvicorn.protocols.http.httptools_impl",
                   "uvloop")  # fmt: skip

_IMPORT_PROBE = """
import importlib, json, sys
bad = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as exc:
        bad[m] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps(bad))
"""


def unimportable(paths: list[str], modules: tuple[str, ...] = SERVING_MODULES, timeout: float = 120) -> dict[str, str]:
    """The ``modules`` a fresh interpreter with ``paths`` in front cannot import, each with its
    error: a bundle that misses a wheel shows here, by name, before a stage needs it (a
    sclsd-http that cannot start says only that it did not)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *modules], env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"(probe)": f"importing {', '.join(modules)} took over {timeout:.0f} s"}
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"(probe)": f"exit {done.returncode}: {done.stderr.strip()[-200:]}"}



# --------------------------------------------------------------------------- the command


def stand_in(work: Path) -> Path:
    """A stand-in for the box on this machine: a venv of this interpreter that sees, through
    links into this environment, only the box's own stack (:data:`BOX_OWN`, what it requires,
    and no more), less what sclsd's requirements bring (which the bundle must carry). Returns
    its python. Stricter than a box, whose transformers may bring some of those itself."""
    import venv

    own = set(closure([n for n in BOX_OWN if _installed(n)], own=frozenset({"triton"})))
    own -= set(closure(sclsd_roots()))
    links = work / "own"
    links.mkdir(parents=True, exist_ok=True)
    for name in sorted(own):
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            src, dst = Path(str(dist.locate_file(top))), links / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    venv.create(work / "venv", with_pip=True)  # setup installs with the box's pip
    python = work / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(site) / "box-own.pth").write_text(f"{links.resolve()}\n")
    return python


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def rehearse(dest: Path, work: Path) -> dict[str, str]:
    """Install ``dest``'s wheels, as this interpreter's builds of the same versions, in a
    :func:`stand_in` for the box, as ``gpu-check``'s setup does there, and return what it
    cannot import (:func:`unimportable`; empty: the bundle serves)."""
    from packaging.utils import parse_wheel_filename

    whl = work / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    specs = []
    for path in sorted((dest / "whl").glob("*.whl")):
        name, version, _build, tags = parse_wheel_filename(path.name)
        if all(t.abi == "none" and t.platform == "any" for t in tags):
            shutil.copyfile(path, whl / path.name)
        else:
            specs.append(f"{name}=={version}")
    if specs:  # the box's wheels are for its CPython 3.12: the same versions for this one
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(whl), *specs], check=True)  # fmt: skip
    python = stand_in(work / "box")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([python, "-m", "sclsd.bench.gpu_stages", "setup", "--work", str(work / "setup"),
                           "--bundle", str(work)], env=env, capture_output=True, text=True)  # fmt: skip
    try:
        row = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"(setup)": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    lacking = dict(row.get("unimportable") or {})
    lacking.update({w: "failed to install" for w in row.get("failed") or []})
    return lacking


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", type=Path, help="the bundle (prepare.sh's DEST), e.g. .gpu-bundle")
    p.add_argument("--dry-run", action="store_true", help="list what is missing, download nothing")
    p.add_argument("--rehearse", action="store_true",
                   help="then install the bundle in a stand-in for the box on this machine (a venv that "
                        "sees only the box's own stack) and import what serving needs")  # fmt: skip


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
    else:
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
    if not args.rehearse:
        return 0
    import tempfile

    print("gpu-bundle: rehearsing the box's setup in a stand-in (10-20 s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        lacking = rehearse(dest, Path(tmp))
    for module, error in lacking.items():
        print(f"gpu-bundle: the stand-in cannot import {module}: {error}", file=sys.stderr)
    if not lacking:
        print("gpu-bundle: the stand-in installed the bundle and imports everything serving needs")
    return 1 if lacking else 0
