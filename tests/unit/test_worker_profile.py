"""worker/profile.py against the fake engine: samples, fit, budget, JSON output."""

from __future__ import annotations

import json

import pytest

from sclsd.core.profiles import load_profile
from worker.profile import Budget, main, profile_engine, synthetic_batch


def test_synthetic_batch_shape():
    b = synthetic_batch(7, 3, 50, 9, vocab=1000)
    assert b.slice_len == 9 and len(b.requests) == 3
    for r in b.requests:
        assert len(r.token_ids) == 50 and all(3 <= t < 1000 for t in r.token_ids)
        assert r.ignore_eos and r.temperature == 0.0 and r.max_new_tokens == 9
    assert len({r.rid for r in b.requests}) == 3


class ClockEngine:
    """An engine whose reported stats follow a known estimator exactly (no sleeping)."""

    def __init__(self):
        from worker.engines.base import EngineInfo

        self._info = EngineInfo("clock", "m", "cpu", 1000, 10**9, vocab_size=500)
        self.calls = 0

    def info(self):
        return self._info

    def serve(self, batch):
        from sclsd.protocol import BatchStats

        self.calls += 1
        n, L, S = len(batch.requests), len(batch.requests[0].token_ids), batch.slice_len
        pre = 1e-5 * n * L + 2e-4 * n + 1e-5 * L + 1e-3
        # decode step j of S - 1 attends over L + j tokens
        dec = sum(2e-7 * n * (L + j) + 1e-4 * n + 3e-3 for j in range(1, S))
        return [], BatchStats(prefill_s=pre, decode_s=dec, iterations=S, batch_size=n, input_len=L)

    def close(self):
        pass


def test_profile_engine_recovers_the_engine_model():
    eng = ClockEngine()
    prof = profile_engine(eng, budget=Budget(60), slice_len=16, decode_steps=8, name="t")
    e = prof.estimator
    assert e.p1 == pytest.approx(1e-5, rel=1e-3)
    assert e.d1 == pytest.approx(2e-7, rel=1e-3)
    assert e.d4 == pytest.approx(3e-3, rel=1e-3)
    assert prof.rmse["prefill_s"] < 1e-6 and prof.rmse["decode_s"] < 1e-6
    # The batch RMSE is the one-step bias of eq. 2 (S steps) against an engine doing S - 1.
    assert 0 < prof.rmse["batch_s"] < 0.1
    assert prof.source == "measured" and prof.kv_bytes_per_token == 1000
    assert len(prof.samples["prefill"]) >= 20 and prof.samples["batch"]


def test_cli_with_fake_engine(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main([
        "--engine", "fake", "--out", str(out), "--budget-s", "30", "--slice-len", "8",
        "--opt", "decode_s=0.0005", "--opt", "prefill_s_per_token=1e-7", "--name", "fk",
    ])  # fmt: skip
    assert rc == 0
    prof = load_profile(str(out))
    assert prof.name == "fk" and prof.engine == "fake" and prof.source == "measured"
    assert prof.kv_bytes_per_token == 46_080
    assert set(prof.rmse) == {"prefill_s", "decode_s", "batch_s"}
    assert prof.estimator.d4 == pytest.approx(0.0005, rel=0.5)
    assert json.loads(out.read_text())["samples"]["decode"]
    assert "wrote" in capsys.readouterr().out


def test_cli_too_small_a_budget_fails_cleanly(tmp_path):
    rc = main(["--engine", "fake", "--out", str(tmp_path / "p.json"), "--budget-s", "0.001"])
    assert rc == 1 and not (tmp_path / "p.json").exists()


def test_cli_rejects_bad_args(tmp_path):
    assert main(["--engine", "fake", "--out", str(tmp_path / "x"), "--slice-len", "1"]) == 2


class ColdClockEngine(ClockEngine):
    """ClockEngine on a GPU: the first call of each shape costs three times a later one, and
    every fifth call is slowed by a hiccup of 50 %."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[int, int, int]] = set()

    def serve(self, batch):
        import msgspec

        outs, st = super().serve(batch)
        shape = (len(batch.requests), len(batch.requests[0].token_ids), batch.slice_len)
        factor = 1.0 if shape in self.seen else 3.0
        self.seen.add(shape)
        if self.calls % 5 == 0:
            factor *= 1.5
        return outs, msgspec.structs.replace(st, prefill_s=st.prefill_s * factor, decode_s=st.decode_s * factor)


def test_gpu_profiles_warm_each_shape_and_keep_the_median():
    warm = profile_engine(ColdClockEngine(), budget=Budget(60), slice_len=16, decode_steps=8, name="w",
                          warm_shapes=True, repeats=3)
    cold = profile_engine(ColdClockEngine(), budget=Budget(60), slice_len=16, decode_steps=8, name="c")
    assert warm.estimator.d4 == pytest.approx(3e-3, rel=1e-2)
    assert warm.rmse["prefill_s"] < 1e-6 and warm.rmse["decode_s"] < 1e-6  # hiccups out-voted
    # Timing first calls and hiccups (the CPU's way) leaves them in the samples.
    assert cold.rmse["prefill_s"] > 0.01 and cold.rmse["decode_s"] > 1e-3


def test_cli_defaults_follow_the_device(tmp_path, monkeypatch):
    seen = {}

    def fake_profile(engine, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr("worker.profile.profile_engine", fake_profile)
    assert main(["--engine", "fake", "--out", str(tmp_path / "p.json")]) == 1
    assert (seen["warm_shapes"], seen["repeats"], seen["decode_steps"]) == (False, 2, 8)


def test_profile_opts_are_typed_by_their_declaration() -> None:
    """``--opt kv_reuse=false`` reached the engine as the text "false", which is true."""
    from worker.profile import _parse_opts

    got = _parse_opts(["kv_reuse=false", "graph_batch_sizes=4,1,2", "static_cache=auto", "dtype=float16",
                       "threads=2"])
    assert got == {"kv_reuse": False, "graph_batch_sizes": (1, 2, 4), "static_cache": "auto",
                   "dtype": "float16", "threads": 2}
    assert got["kv_reuse"] is False
    with pytest.raises(SystemExit, match="static_share"):
        _parse_opts(["static_share=2"])
