"""The policy core stays pure: no zmq, torch, asyncio (nor a clock) behind `import sclsd.core`."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import sclsd.core

FORBIDDEN = ("zmq", "torch", "asyncio", "uvloop", "transformers")
CORE_DIR = Path(sclsd.core.__file__).parent


def core_modules() -> list[str]:
    return sorted(f"sclsd.core.{m.name}" for m in pkgutil.iter_modules([str(CORE_DIR)]))


def test_core_has_the_expected_modules():
    mods = set(core_modules())
    for m in ("estimator", "memory", "batcher", "offloader", "policy", "profiles", "scheduler"):
        assert f"sclsd.core.{m}" in mods


def test_importing_core_pulls_in_no_io_or_ml_stack():
    mods = ["sclsd.core", *core_modules()]
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "from sclsd.core.profiles import load_profile, builtin_profiles\n"
        "for n in builtin_profiles(): load_profile(n).cost().t_serve(4, 100, 128)\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_core_sources_import_no_clock():
    """Time is an argument: no module of the core imports time or datetime."""
    for path in CORE_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                root = name.split(".")[0]
                assert root not in ("time", "datetime", *FORBIDDEN), f"{path.name} imports {name}"
