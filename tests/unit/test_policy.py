"""The ablation ladder: each named policy drives the real Scheduler through a few rounds."""

from __future__ import annotations

import pytest

from sclsd.core.batcher import DPBatcher, FCFSBatcher
from sclsd.core.offloader import AdaptiveInterval, FixedInterval, MaxMin, RoundRobin
from sclsd.core.policy import DEFAULT_POLICY, POLICIES, make_policy
from sclsd.core.profiles import load_profile
from sclsd.core.request import Request, State
from sclsd.core.scheduler import BatchOutcome, RowOutcome, Scheduler

COST = load_profile("a100-llama2-13b-hf").cost()


def make_sched(name, workers=("w0", "w1"), **kw):
    s = Scheduler(make_policy(name, **kw), COST)
    for w in workers:
        s.add_worker(w)
    return s


def add(s, lens, max_tokens, now=0.0):
    for k, L in enumerate(lens):
        s.add(Request(f"r{len(s.live)}-{k}", L, max_tokens, arrival=now + k * 1e-3), now)


def outcome(batch, finish_ids=(), new_tokens=None):
    """Every row generates ``new_tokens`` (default: the whole slice); ``finish_ids`` stop."""
    rows = []
    for r in batch.requests:
        n = min(batch.slice_len, r.remaining) if new_tokens is None else new_tokens
        rows.append(RowOutcome(r.rid, n, "stop" if r.rid in finish_ids else None))
    return BatchOutcome(batch.bid, rows, elapsed=batch.est_time)


def test_names_and_default():
    assert POLICIES == ("sls", "so", "pm", "ab", "lb", "scls")
    assert DEFAULT_POLICY == "scls"
    assert make_policy().name == "scls"
    with pytest.raises(ValueError):
        make_policy("fcfs")
    with pytest.raises(ValueError):
        make_policy("scls", slice_len=0)


def test_compositions_match_the_ladder():
    kw = dict(slice_len=64, max_gen=512, batch_size=12, gamma=2.0, lam=0.25)
    p = {n: make_policy(n, **kw) for n in POLICIES}
    assert p["sls"].slice_len == 512 and all(p[n].slice_len == 64 for n in POLICIES[1:])
    for n in ("sls", "so"):
        assert p[n].batcher == FCFSBatcher(12)
    assert p["pm"].batcher == DPBatcher(12)
    for n in ("ab", "lb", "scls"):
        assert p[n].batcher == DPBatcher()
    for n in ("sls", "so", "pm", "ab"):
        assert isinstance(p[n].offloader, RoundRobin)
    for n in ("lb", "scls"):
        assert isinstance(p[n].offloader, MaxMin)
    for n in POLICIES[:-1]:
        assert p[n].interval == FixedInterval(2.0)
    assert p["scls"].interval == AdaptiveInterval(0.25, 2.0)


@pytest.mark.parametrize("name", POLICIES)
def test_policy_drives_the_scheduler(name):
    s = make_sched(name)
    lens = [10] * 30 + [1000] * 3 + [300] * 5
    add(s, lens, max_tokens=300)
    assert s.due(0.0)
    batches = s.schedule(0.0).batches
    S = s.policy.slice_len
    assert sum(b.size for b in batches) == len(lens) and not s.pool
    for b in batches:
        assert b.slice_len == S and b.worker in ("w0", "w1")
        assert b.input_len == max(r.input_len for r in b.requests)
        assert not COST.oom(b.size, b.input_len, S) or b.size == 1
        assert b.est_time == pytest.approx(COST.t_serve(b.size, b.input_len, S))
    loads = s.loads()
    assert sum(loads.values()) == pytest.approx(sum(b.est_time for b in batches))
    assert s.next_at == pytest.approx(s.interval)

    # Round 1 results: the first request of each batch stops, the others run the slice.
    stop = {b.requests[0].rid for b in batches}
    done = []
    for b in batches:
        done += s.on_result(outcome(b, finish_ids=stop), now=5.0).ended
    assert all(r.state is State.FINISHED for r in done)
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in s.loads().values())
    if S >= 300:  # sls: one "slice" is the whole generation budget -> nothing re-queued
        assert len(done) == len(lens) and not s.pool and not s.live
        return
    assert {r.rid for r in done} == stop
    assert len(s.pool) == len(lens) - len(stop)
    for r in s.pool.values():
        assert r.state is State.QUEUED and r.num_generated == S and r.input_len == r.prompt_len + S

    # Round 2: re-queued requests are batched with newcomers by their new context length.
    add(s, [20, 20], max_tokens=300, now=6.0)
    batches2 = s.schedule(max(6.0, s.next_at)).batches
    assert sum(b.size for b in batches2) == len(lens) - len(stop) + 2
    for b in batches2:
        s.on_result(outcome(b), now=20.0)
    assert s.stats().slices == len(lens) + len(lens) - len(stop) + 2


def test_fixed_batch_size_caps_sls_so_pm_but_not_ab():
    sizes = {}
    for name in POLICIES:
        s = make_sched(name, batch_size=16)
        add(s, [20] * 64, max_tokens=100)
        sizes[name] = max(b.size for b in s.schedule(0.0).batches)
    assert all(sizes[n] <= 16 for n in ("sls", "so", "pm"))
    assert all(sizes[n] > 16 for n in ("ab", "lb", "scls"))


def test_pm_mitigates_padding_where_so_does_not():
    def padding(name):
        s = make_sched(name, workers=("w0",))
        add(s, [10, 1000] * 8, max_tokens=100)
        return sum(b.size * b.input_len - sum(r.input_len for r in b.requests) for b in s.schedule(0.0).batches)

    assert padding("pm") < padding("so")


def test_lb_balances_where_ab_round_robins():
    def spread(name):
        s = make_sched(name, workers=("w0", "w1"))
        # DP makes three batches (~11.8 s, ~9.7 s, ~5.7 s): round-robin stacks the
        # first and the last on w0, max-min puts the last with the second.
        add(s, [1000] * 14 + [10] * 60 + [500] * 20, max_tokens=500)
        s.schedule(0.0)
        v = list(s.loads().values())
        return max(v) - min(v)

    assert spread("lb") < spread("ab")


def test_scls_interval_is_adaptive_and_others_fixed():
    for name in POLICIES:
        s = make_sched(name, gamma=1.0, lam=0.5)
        add(s, [500] * 200, max_tokens=500)
        s.schedule(0.0)
        min_load = min(s.loads().values())
        if name == "scls":
            assert min_load > 2.0
            assert s.interval == pytest.approx(0.5 * min_load)
        else:
            assert s.interval == 1.0


def test_switches_are_off_by_default_and_apply_to_every_policy():
    for n in POLICIES:
        p = make_policy(n, slice_len=64)
        assert not p.work_conserving and not p.kv_reuse  # the paper
        q = make_policy(n, slice_len=64, work_conserving=True, kv_reuse=True)
        assert q.work_conserving and q.kv_reuse and q.batcher == p.batcher
    assert make_policy("scls", slice_len=128).first_slice_len == 16
    assert make_policy("scls", slice_len=4).first_slice_len == 1


def test_daemon_config_and_command_line_reach_the_policy():
    from sclsd.config import load, override
    from sclsd.daemon.cli import build_parser
    from sclsd.daemon.cost import DaemonCost
    from sclsd.daemon.server import make_scheduler

    # The switches shape the static policies' rounds (scls-cb, the default, has none).
    cfg = override(load(None), scheduler__policy="scls")
    assert cfg.scheduler.work_conserving and cfg.scheduler.kv_reuse  # shipped defaults
    sched = make_scheduler(cfg, DaemonCost.initial(cfg))
    assert sched.policy.work_conserving and sched.policy.kv_reuse
    args = build_parser().parse_args(["--no-work-conserving", "--kv-reuse"])
    off = override(cfg, scheduler__work_conserving=args.work_conserving,
                   scheduler__kv_reuse=args.kv_reuse)
    sched = make_scheduler(off, DaemonCost.initial(off))
    assert not sched.policy.work_conserving and sched.policy.kv_reuse
    assert build_parser().parse_args([]).work_conserving is None  # not given: the config's
