"""The README's parameter table and docs/operations.md match the code: every parameter
the endpoints take is documented and nothing else is; every ``[http]`` key is in the
table; every test the Guarantees name exists."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from sclsd.config import HttpConfig
from sclsd.http.openapi import PARAMS
from sclsd.http.params import ALLOWED

REPO = Path(__file__).resolve().parents[3]


def _table_after(text: str, marker: str) -> list[str]:
    """First cells of the Markdown table that follows ``marker``."""
    rest = text[text.index(marker):]
    rows = re.findall(r"^\| (.+?) \|", rest[rest.index("\n|"):].split("\n\n")[0], re.M)
    return rows[1:] if rows and rows[0] in ("parameter", "key") else rows


def test_readme_parameter_table_is_what_the_endpoints_take() -> None:
    readme = (REPO / "README.md").read_text()
    cells = _table_after(readme, "Parameters (both endpoints unless marked")
    documented = {name for cell in cells for name in re.findall(r"`(\w+)`", cell.split(" (")[0])}
    documented |= {name for cell in cells for name in re.findall(r"^`(\w+)`", cell)}
    taken = set(ALLOWED["completion"]) | set(ALLOWED["chat"])
    assert documented - taken == set(), "documented but not taken"
    assert taken - documented == set(), "taken but not documented"
    assert set(PARAMS) == taken  # the OpenAPI schema's table too


def test_operations_lists_every_http_key() -> None:
    ops = (REPO / "docs" / "operations.md").read_text()
    cells = _table_after(ops, "## sclsd-http")
    keys = {re.sub(r"`", "", c) for c in cells}
    assert keys == {f.name for f in fields(HttpConfig)}


def test_guarantees_name_tests_that_exist() -> None:
    ops = (REPO / "docs" / "operations.md").read_text()
    part = ops[ops.index("**The HTTP door holds its limits.**"):ops.index("## Capacity")]
    sources = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    names = re.findall(r"`(test_\w+)`", part)
    assert len(names) >= 8
    for name in names:
        assert f"def {name}(" in sources, name
