"""What the README states about the code, checked against the code (its commands run in
tests/integration/test_readme.py, which needs the built-in model): the defaults it
names, and the load generators' commands in the form their pinned versions take."""

from __future__ import annotations

import re
from pathlib import Path

import sclsd.ctl as ctl
from sclsd.config import ModelConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _one(pattern: str) -> str:
    found = re.findall(pattern, README, re.S)
    assert len(found) == 1, (pattern, found)
    return str(found[0])


def test_the_default_of_sclsctl_submit_max_tokens_is_the_one_stated() -> None:
    args = ctl.build_parser().parse_args(["submit", "Hi"])
    assert int(_one(r"`sclsctl submit` always sends a\s+`--max-tokens`, (\d+) unless given")) == args.max_tokens


def test_the_default_of_an_open_max_tokens_is_the_one_stated() -> None:
    m = ModelConfig()
    stated = {int(n) for n in re.findall(r"`model\.default_max_tokens` \((\d+) by default", README)}
    stated |= {int(n) for n in re.findall(r"`\[model\] default_max_tokens`, (\d+) tokens by default", README)}
    assert stated == {m.default_max_tokens}
    assert int(_one(r"above `model\.max_gen` \((\d+) by default\)")) == m.max_gen


def test_the_load_generators_commands_take_their_pinned_versions_form() -> None:
    # guidellm 0.8 has `run` (no `benchmark`) with kind=... option groups; aiperf `profile`.
    guidellm = _one(r"```sh\n(guidellm .*?)```")
    assert guidellm.startswith("guidellm run ") and "benchmark" not in guidellm
    for option in ("--backend kind=openai_http,target=", "--tokenizer kind=huggingface_auto,model=$(",
                   "--data kind=synthetic_text,", "--profile kind=concurrent,", "--constraint kind=max_requests,"):
        assert option in guidellm, option
    aiperf = _one(r"```sh\n(aiperf .*?)```")
    assert aiperf.startswith("aiperf profile ") and "--tokenizer $(" in aiperf
    assert "guidellm==0.8.1" in README and "aiperf==0.13.0" in README


def test_the_readme_says_how_to_stop_what_it_started_and_which_python_runs_the_examples() -> None:
    using = README[README.index("\n## Using it"):README.index("\n## Choosing a policy")]
    started = re.findall(r"^\.venv/bin/(sclsd(?:-http)?) .*&(?:\s+#.*)?$", using, re.M)
    assert started == ["sclsd", "sclsd-http"]
    stop = _one(r"```sh\n(kill %\d+ %\d+)\s+#")
    assert sorted(stop.split()[1:]) == ["%1", "%2"]
    assert ".venv/bin/python example.py" in using
