"""``sclsd-bench gpu-bundle``: the wheels a GPU box needs, walked from the requirements, and
``gpu-check``'s setup probe that names a module the box cannot import."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from sclsd.bench import gpu_bundle as B
from sclsd.bench import gpu_report as R


def test_the_closure_follows_what_each_package_requires_with_its_extras() -> None:
    """fastapi's own imports (annotated-doc, anyio and anyio's idna) come with it; uvicorn's
    ``standard`` extra brings httptools, which sclsd-http's server imports; an extra nobody
    asked for (fastapi's ``all``) brings nothing."""
    got = B.closure(["fastapi", "uvicorn[standard]"])
    for name in ("fastapi", "starlette", "annotated-doc", "anyio", "idna", "pydantic-core",
                 "typing-inspection", "uvicorn", "click", "h11", "httptools"):
        assert name in got, name
    assert "python-multipart" not in got and "itsdangerous" not in got
    assert "httptools" not in B.closure(["uvicorn"])
    from importlib.metadata import version

    assert got["anyio"] == version("anyio")


def test_the_box_own_stack_is_neither_followed_nor_bundled() -> None:
    got = B.closure(["gguf", "transformers", "torch"])
    assert "gguf" in got
    assert not {"numpy", "requests", "tqdm", "pyyaml", "transformers", "torch", "huggingface-hub"} & set(got)
    assert not [n for n in got if n.startswith("nvidia-")]


def test_markers_are_read_for_the_box_not_for_this_interpreter() -> None:
    """starlette needs typing-extensions below Python 3.13 and anyio below 3.15: on the box's
    3.12 it is bundled, on a 3.15 box it would not be."""
    assert "typing-extensions" in B.closure(["starlette"], own=frozenset())
    assert "typing-extensions" not in B.closure(["starlette"], own=frozenset(),
                                                env={**B.BOX_ENV, "python_version": "3.15",
                                                     "python_full_version": "3.15.0"})


def test_sclsd_roots_carry_uvicorns_extra_and_its_closure_has_the_http_server() -> None:
    roots = B.sclsd_roots()
    assert "uvicorn[standard]" in roots and "fastapi" in roots
    assert {"httptools", "annotated-doc", "anyio", "llguidance", "msgspec", "pyzmq"} <= set(B.closure(roots))


def test_a_requirement_not_installed_here_is_named() -> None:
    with pytest.raises(LookupError, match="no-such-dist-sclsd"):
        B.closure(["no-such-dist-sclsd"])


def test_missing_is_what_the_bundle_lacks(tmp_path: Path) -> None:
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl-extra").mkdir()
    for name in ("fastapi-0.1-py3-none-any.whl", "Annotated_Doc-0.0.7-py3-none-any.whl", "not-a-wheel.whl"):
        (tmp_path / "whl" / name).write_bytes(b"")
    (tmp_path / "whl-extra" / "idna-3.0-py3-none-any.whl").write_bytes(b"")
    assert B.bundled(tmp_path) == {"fastapi", "annotated-doc", "idna"}
    lack = B.missing(tmp_path, ["fastapi"])
    assert "anyio" in lack and "starlette" in lack
    assert not {"fastapi", "annotated-doc", "idna"} & set(lack)


def test_run_refuses_a_directory_that_is_not_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert B.run(argparse.Namespace(dest=tmp_path, dry_run=True)) == 2
    assert "prepare.sh" in capsys.readouterr().err


def test_the_setup_probe_names_what_the_box_cannot_import(tmp_path: Path) -> None:
    """A module that only a missing wheel would bring is named with its error; the path given
    is put in front (a bundle's installed wheels)."""
    (tmp_path / "sclsd_probe_mod.py").write_text("import sclsd_no_such_dependency\n")
    (tmp_path / "sclsd_probe_ok.py").write_text("X = 1\n")
    bad = B.unimportable([str(tmp_path)], ("sclsd_probe_ok", "sclsd_probe_mod", "json"))
    assert list(bad) == ["sclsd_probe_mod"]
    assert "sclsd_no_such_dependency" in bad["sclsd_probe_mod"]


def test_this_environment_imports_everything_serving_needs() -> None:
    """The probe's list is importable where the tests run: a module renamed in the list, or a
    dependency dropped from pyproject, fails here rather than on a card."""
    assert B.unimportable([str(Path(__file__).resolve().parents[2])]) == {}


def test_the_summary_shouts_what_the_box_cannot_import() -> None:
    rows = [{"stage": "setup", "phase": "env", "python": sys.executable,
             "unimportable": {"sclsd.http.cli": "ModuleNotFoundError: No module named 'annotated_doc'"}}]
    text = R.render(rows)
    assert "THE BOX CANNOT IMPORT `sclsd.http.cli`" in text and "annotated_doc" in text
    assert "CANNOT IMPORT" not in R.render([{"stage": "setup", "phase": "env", "unimportable": {}}])


def _wheel(where: Path, name: str, module: str, body: str) -> Path:
    """A minimal pure-Python wheel holding ``module``."""
    import zipfile

    path = where / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_install_puts_the_wheels_on_the_path_it_returns(tmp_path: Path) -> None:
    """What setup installs lands in ``WORK/site``, which the row gives the later stages."""
    bundle = tmp_path / "bundle"
    (bundle / "whl").mkdir(parents=True)
    _wheel(bundle / "whl", "sclsd_probe_pkg", "sclsd_probe_pkg", "ANSWER = 42\n")
    row = B.install(bundle, tmp_path / "work")
    assert row["failed"] == [] and row["wheels"] == 1 and row["unimportable"] == {}
    site = tmp_path / "work" / "site"
    assert row["pythonpath"][0] == str(site.resolve()) and (site / "sclsd_probe_pkg.py").is_file()
    assert B.unimportable(row["pythonpath"], ("sclsd_probe_pkg",)) == {}
    assert "sclsd_probe_pkg" in B.unimportable([], ("sclsd_probe_pkg",))


def test_the_scipy_stand_in_fits_as_the_estimator_needs() -> None:
    """The numpy curve_fit a box without scipy gets: with non-negative bounds it finds the
    non-negative coefficients that fit best (the estimator's ``t = c1·x·y + c2·x + c3·y + c4``)."""
    import numpy as np

    ns: dict[str, object] = {}
    exec(B.SCIPY_SHIM, ns)
    rng = np.random.default_rng(0)
    x, y = rng.uniform(1, 64, 200), rng.uniform(16, 2048, 200)
    t = 0.002 * x * y + 0.5 * x + 0.0 * y + 3.0 + rng.normal(0, 0.01, 200)
    popt, _ = ns["curve_fit"](None, np.vstack([x, y]), t, bounds=(0, np.inf))  # type: ignore[operator]
    assert np.allclose(popt, [0.002, 0.5, 0.0, 3.0], rtol=0.01, atol=1e-4) and (popt >= 0).all()
    # A negative slope in the data is clamped to 0, not fitted below it.
    popt, _ = ns["curve_fit"](None, np.vstack([x, y]), 3.0 - 0.001 * y + 0.4 * x, bounds=(0, np.inf))  # type: ignore[operator]
    assert (popt >= 0).all() and popt[2] == 0.0


def test_the_stand_in_sees_the_box_stack_and_not_what_the_bundle_must_carry(tmp_path: Path) -> None:
    """The rehearsal's box: torch and transformers are there; fastapi, anyio and
    typing_extensions (sclsd's requirements, the bundle's to carry: torch imports only once the
    bundle is installed) and pytest (neither's) are not."""
    import subprocess

    python = B.stand_in(tmp_path)
    probe = ("import importlib.util as u; print([m for m in ('torch', 'transformers', 'numpy', 'fastapi', "
             "'anyio', 'annotated_doc', 'typing_extensions', 'pytest') if u.find_spec(m)])")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.strip().splitlines()[-1] == "['torch', 'transformers', 'numpy']"
