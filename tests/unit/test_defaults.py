"""The default config serves with the best policy: scls-cb with sampling, on llama for the
default (GGUF) model on a CPU, on hf-cb for a transformers model; the paper's static scls is
one switch away; a policy with an engine that cannot serve it stops sclsd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sclsd import config as C
from sclsd import defaults as D
from sclsd.daemon.supervisor import Supervisor
from sclsd.engine_options import OPTIONS

REPO = Path(__file__).resolve().parents[2]


def _command(cfg: C.Config) -> list[str]:
    """The command line the supervisor spawns worker w0 with."""
    sup = Supervisor(cfg, "/tmp", None, lambda wid: [], lambda wid, why: None, lambda wid: None)
    return sup.command("w0", 0)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_the_defaults_are_scls_cb_on_llama_for_the_gguf_with_sampling() -> None:
    for cfg in (C.load(None), C.load(REPO / "etc" / "sclsd.toml")):
        assert cfg.scheduler.policy == "scls-cb" and cfg.workers.engine == "auto"
        assert cfg.engine == "llama"
        cmd = _command(cfg)
        assert _flag(cmd, "--engine") == "llama"
        assert "--dtype" not in cmd and "--batching" not in cmd  # the GGUF's weights as they are
    tiny = C.from_dict({"model": {"name": "tiny-random"}})
    # A transformers model takes the arena on the CPU too (1.4x hf-cb's requests/s there), with
    # hf-cb as its fallback for a model it cannot hold.
    assert tiny.engine == "hf-static-cb" and _flag(_command(tiny), "--engine") == "hf-static-cb"
    assert _flag(_command(tiny), "--engine-fallback") == "hf-cb"
    assert C.from_dict({"workers": {"device": "cuda"}}).engine == "hf-static-cb"
    # Sampling is on unless a config turns it off: the daemon's view before any worker
    # registers, the worker's flag (not passed, so the engine's default) and the engine's.
    assert OPTIONS["sampling"].default is True
    assert "--sampling" not in _command(C.load(None))
    from worker.engines.hf_cb import HFCBEngine
    from worker.main import build_parser

    assert build_parser().parse_args(["--connect", "ipc:///x", "--id", "w"]).engine == "auto"
    import inspect

    assert inspect.signature(HFCBEngine.__init__).parameters["sampling"].default is True


@pytest.mark.parametrize("policy", ["scls", "sls", "lb"])
def test_a_static_policy_alone_switches_a_transformers_model_to_hf(policy: str) -> None:
    cfg = C.from_dict({"scheduler": {"policy": policy}, "model": {"name": "tiny-random"}})
    assert cfg.engine == "hf" and _flag(_command(cfg), "--engine") == "hf"
    # The same from the command line, over the shipped file (sclsd --policy scls).
    over = C.override(C.load(REPO / "etc" / "sclsd.toml"), scheduler__policy=policy, model__name="tiny-random")
    assert over.engine == "hf"
    # Back to the default policy: the engine follows again.
    assert C.override(over, scheduler__policy="scls-cb").engine == "hf-static-cb"
    # The default GGUF on the CPU stays on llama, which serves static slices too.
    assert C.from_dict({"scheduler": {"policy": policy}}).engine == "llama"


def test_llama_needs_the_cpu_and_the_ggufs_own_weights() -> None:
    for bad, why in (({"workers": {"engine": "llama", "device": "cuda"}}, "workers.device = 'cuda'"),
                     ({"workers": {"engine": "llama"}, "model": {"dtype": "bfloat16"}}, "model.dtype = 'bfloat16'")):
        with pytest.raises(C.ConfigError) as exc:
            C.from_dict(bad)
        assert exc.value.key == "workers.engine" and why in str(exc.value)


def test_an_explicit_engine_wins_and_a_fitting_pair_loads() -> None:
    assert C.from_dict({"scheduler": {"policy": "scls"}, "workers": {"engine": "hf-cb"}}).engine == "hf-cb"
    assert C.override(C.load(None), workers__engine="hf", scheduler__policy="scls").engine == "hf"
    # An explicit engine stays when the policy changes.
    cfg = C.from_dict({"scheduler": {"policy": "scls"}, "workers": {"engine": "hf"}})
    assert C.override(cfg, scheduler__policy="sls").engine == "hf"


def test_hf_static_cb_serves_scls_cb_with_its_arena_options_and_is_auto_for_a_transformers_model() -> None:
    """Selectable by name for scls-cb (with the arena's options, passed to its workers); the
    engine auto picks for grants on a transformers model is one constant, on CUDA and on the
    CPU: the arena, measured ahead of hf-cb on a card and on the CPU, with hf-cb as the
    fallback for a model it cannot hold."""
    cfg = C.from_dict({"workers": {"engine": "hf-static-cb", "device": "cuda",
                                   "options": {"static_share": 0.6, "graph_batch_sizes": "8,32", "kv_reuse": True}}})
    assert cfg.scheduler.policy == "scls-cb" and cfg.engine == "hf-static-cb"
    cmd = _command(cfg)
    assert _flag(cmd, "--engine") == "hf-static-cb" and _flag(cmd, "--static-share") == "0.6"
    with pytest.raises(C.ConfigError) as exc:  # hf-cb's own options are not its
        C.from_dict({"workers": {"engine": "hf-static-cb", "options": {"num_blocks": 64}}})
    assert exc.value.key == "workers.options.num_blocks"
    for device in ("cpu", "cuda"):  # a transformers model (the built-in GGUF runs on llama on the CPU)
        assert C.from_dict({"model": {"name": "tiny-random"}, "workers": {"device": device}}).engine == (
            D.AUTO_GRANT_ENGINE)
    assert C.from_dict({"workers": {"device": "cuda"}}).engine == D.AUTO_GRANT_ENGINE
    assert D.AUTO_GRANT_ENGINE == "hf-static-cb" and D.auto_engine(True, "m", "cuda:0") == D.AUTO_GRANT_ENGINE
    # Chosen by auto, the arena comes with its fallback for a model it cannot hold; named, not.
    auto = _command(C.from_dict({"model": {"name": "tiny-random"}, "workers": {"device": "cuda"}}))
    assert _flag(auto, "--engine") == "hf-static-cb" and _flag(auto, "--engine-fallback") == "hf-cb"
    assert "--engine-fallback" not in cmd and "--engine-fallback" not in _command(C.load(None))
    assert D.auto_engine(False, "m", "cuda") == "hf" and "hf-static-cb" in D.GRANT_ENGINES


def test_the_fake_model_gets_the_fake_engine_taking_grants_under_the_default_policy() -> None:
    for workers in ({}, {"engine": "fake"}):
        cfg = C.from_dict({"model": {"name": "fake"}, "workers": workers})
        assert cfg.scheduler.policy == "scls-cb" and cfg.engine == "fake"
        cmd = _command(cfg)
        assert _flag(cmd, "--engine") == "fake" and _flag(cmd, "--batching") == "continuous"
    static = C.from_dict({"model": {"name": "fake"}, "scheduler": {"policy": "scls"}})
    assert static.engine == "fake" and "--batching" not in _command(static)


@pytest.mark.parametrize("engine", ["hf", "deepspeed"])
def test_scls_cb_with_a_static_engine_is_refused_naming_key_and_value(engine: str) -> None:
    with pytest.raises(C.ConfigError) as exc:
        C.from_dict({"scheduler": {"policy": "scls-cb"}, "workers": {"engine": engine}})
    assert exc.value.key == "workers.engine" and exc.value.value == engine
    assert "'hf-cb'" in str(exc.value) and "'scls'" in str(exc.value)
    # The default policy with that engine, e.g. sclsd --engine hf alone: the same.
    with pytest.raises(C.ConfigError) as exc:
        C.override(C.load(None), workers__engine=engine)
    assert exc.value.key == "workers.engine"


def test_bad_engine_and_policy_values_are_refused() -> None:
    for raw, key in (({"workers": {"engine": "vllm"}}, "workers.engine"),
                     ({"scheduler": {"policy": "scls-cbx"}}, "scheduler.policy")):
        with pytest.raises(C.ConfigError) as exc:
            C.from_dict(raw)  # type: ignore[arg-type]
        assert exc.value.key == key
    with pytest.raises(C.ConfigError, match="must be one of auto, hf, hf-cb"):
        C.from_dict({"workers": {"engine": "vllm"}})
    assert D.AUTO_ENGINE == "auto" and D.POLICY == "scls-cb"


def test_sclsd_exits_2_naming_key_and_value_for_an_incompatible_pair(tmp_path: Path) -> None:
    cfg = tmp_path / "sclsd.toml"
    cfg.write_text('[workers]\nengine = "hf"\n')  # the default policy is scls-cb
    out = subprocess.run([sys.executable, "-m", "sclsd.daemon", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "workers.engine = 'hf'" in out.stderr and "scls-cb" in out.stderr
    # One switch on the command line mends it (sclsd --config FILE --policy scls): the
    # changes go into the file's values before they are checked.
    assert C.load(cfg, scheduler__policy="scls").engine == "hf"
    with pytest.raises(C.ConfigError) as exc:
        C.load(cfg, scheduler__policy="scls-cb", workers__spawn=1)
    assert exc.value.key == "workers.engine" and exc.value.value == "hf"
