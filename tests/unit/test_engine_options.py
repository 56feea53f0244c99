"""Engine options declared once (:data:`sclsd.engine_options.OPTIONS`) and typed once
(:func:`parse_option`): the value a config or a command line gives, the worker's flags made
from the declarations, and the command line the daemon spawns a worker with, read back."""

from __future__ import annotations

from typing import Any

import pytest

from sclsd import config as C
from sclsd.daemon.supervisor import Supervisor
from sclsd.engine_options import OPTIONS, Choice, Option, Range, check_option, parse_option
from worker import main as wm
from worker.engines.static_cache import as_switch
from worker.engines.static_grid import parse_sizes

HEAD = ["--connect", "ipc:///x", "--id", "w"]


@pytest.mark.parametrize(
    ("key", "value", "typed"),
    [
        ("graph_batch_sizes", "1,2,4", (1, 2, 4)),
        ("graph_batch_sizes", " 4, 1,2,2 ", (1, 2, 4)),
        ("graph_batch_sizes", "8", (8,)),
        ("graph_batch_sizes", [8, 2], (2, 8)),
        ("graph_batch_sizes", (4, 1), (1, 4)),
        ("graph_cache_tokens", "[256, 512]", (256, 512)),  # str() of a TOML list, as the daemon passes it
        ("static_cache", "auto", "auto"),
        ("static_cache", "True", True),  # str(True)
        ("cuda_graphs", "false", False),
        ("cuda_graphs", False, False),
        ("kv_reuse", "false", False),
        ("kv_reuse", "TRUE", True),
        ("kv_reuse", True, True),
        ("num_blocks", "128", 128),
        ("num_blocks", 128, 128),
        ("memory_share", "0.8", 0.8),
        ("static_share", 1, 1.0),
        ("decode_s", "1e-07", 1e-07),
        ("prefill_chunk_tokens", "0", 0),
        ("batching", "continuous", "continuous"),
        ("dtype", "bfloat16", "bfloat16"),
    ],
)
def test_a_value_is_typed_by_its_declared_kind(key: str, value: Any, typed: Any) -> None:
    got = parse_option(key, value)
    assert got == typed and type(got) is type(typed), (got, typed)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("kv_reuse", "yes", "must be true or false"),
        ("kv_reuse", "1", "must be true or false"),
        ("kv_reuse", "auto", "must be true or false"),  # a bool, not a switch
        ("kv_reuse", 1, "must be true or false"),
        ("static_cache", "maybe", 'must be true, false or "auto"'),
        ("num_blocks", "0", "must be >= 1"),
        ("num_blocks", "1.5", "must be an integer"),
        ("num_blocks", True, "must be an integer"),
        ("vocab", "50", "must be >= 256"),
        ("memory_share", "nan", "must be a finite number"),
        ("memory_share", "x", "must be a number"),
        ("static_share", "1.5", "must be in (0, 1]"),
        ("static_share", 0, "must be in (0, 1]"),
        ("graph_batch_sizes", "1,x", "positive integers"),
        ("graph_batch_sizes", "0,2", "positive integers"),
        ("graph_batch_sizes", "1,2,", "positive integers"),
        ("graph_batch_sizes", "", "positive integers"),
        ("graph_batch_sizes", "²", "positive integers"),  # a digit int() cannot read
        ("graph_batch_sizes", 8, "positive integers"),
        ("batching", "dynamic", "must be one of static, continuous"),
        ("dtype", "int8", "must be one of"),
        ("warp_speed", "9", "unknown engine option"),
    ],
)
def test_a_bad_value_is_refused_with_the_key_and_why(key: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=r"^" + key + ": ") as exc:
        parse_option(key, value)
    assert why in str(exc.value)
    if not isinstance(value, str):  # a TOML value: the config's reason, word for word
        assert f"{key}: {check_option(None, key, value)}," in str(exc.value)


def _sample(opt: Option) -> str:
    """A good value of ``opt`` as command-line text."""
    rule = opt.rule
    if opt.kind == "choice":
        assert isinstance(rule, Choice)
        return (rule.values or tuple(rule.of() if rule.of else ()))[0]
    if opt.kind == "int":
        return str(int(rule.ge)) if isinstance(rule, Range) and rule.ge is not None else "1"
    if opt.kind == "float":
        return str(rule.le) if isinstance(rule, Range) and rule.le is not None else "1.5"
    return {"bool": "false", "switch": "auto", "sizes": "4,1"}[opt.kind]


def test_every_option_is_a_flag_from_its_declaration_typed_by_it() -> None:
    parser = wm.build_parser()
    flags = {a.dest: a for a in parser._actions}
    argv = [*HEAD, "--engine", "fake"]
    for key, opt in OPTIONS.items():
        flag = f"--{key.replace('_', '-')}"
        assert flag in flags[key].option_strings, key
        if key in wm.OWN_FLAGS:
            continue
        assert opt.help in (flags[key].help or "").replace("%%", "%"), key
        argv += [flag, _sample(opt)]
    opts = wm.engine_options(parser.parse_args(argv))
    for key, opt in OPTIONS.items():
        if key not in wm.OWN_FLAGS:
            want = parse_option(key, _sample(opt))
            assert opts[key] == want and type(opts[key]) is type(want), key
    assert "dtype" not in opts  # --dtype not given: the engine's default


def test_each_spelling_of_a_flag_gives_the_typed_value() -> None:
    def opts(*extra: str) -> dict[str, Any]:
        return wm.engine_options(wm.build_parser().parse_args([*HEAD, "--engine", "hf", *extra]))

    got = opts("--graph-batch-sizes", "1,2,4", "--static-cache", "auto", "--kv-reuse", "false",
               "--static-share=0.25", "--opt", "graph-cache-tokens=512,256", "--opt", "cuda_graphs=false")
    assert got["graph_batch_sizes"] == (1, 2, 4) and got["static_cache"] == "auto"
    assert got["kv_reuse"] is False and got["static_share"] == 0.25
    assert got["graph_cache_tokens"] == (256, 512) and got["cuda_graphs"] is False
    assert opts("--kv-reuse", "true", "--opt", "kv_reuse=false")["kv_reuse"] is False  # --opt over the flag
    assert opts("--dtype", "auto")["dtype"] == "auto"  # resolved by load_engine, on its device


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--graph-batch-sizes", "1,x"], "graph_batch_sizes: must be a list of positive integers"),
        (["--static-cache", "maybe"], 'static_cache: must be true, false or "auto"'),
        (["--kv-reuse", "yes"], "kv_reuse: must be true or false"),
        (["--num-blocks=0"], "num_blocks: must be >= 1"),
        (["--batching", "dynamic"], "batching: must be one of static, continuous"),
        (["--opt", "static_share=2"], "static_share: must be in (0, 1]"),
        (["--opt", "no_such_option=1"], "no_such_option: unknown engine option"),
        (["--warp-speed", "9"], "unrecognized arguments: --warp-speed"),
    ],
)
def test_a_bad_flag_stops_the_worker_at_its_command_line(argv: list[str], said: str, capsys,
                                                         monkeypatch) -> None:
    def parsed(*_: Any) -> None:
        raise AssertionError("the command line was taken")  # before the worker would start

    monkeypatch.setattr(wm, "setup_logging", parsed)
    with pytest.raises(SystemExit) as exc:
        wm.main([*HEAD, *argv])
    assert exc.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("engine", "policy", "options"),
    [
        ("hf", "scls", {"static_cache": "auto", "cuda_graphs": False, "static_share": 0.25,
                        "static_buckets": True, "graph_batch_sizes": [1, 2, 4], "graph_cache_tokens": "512,256",
                        "prefill_chunk_tokens": 0, "kv_reuse": True, "kv_retain_bytes": 1024,
                        "kv_host_bytes": 0}),
        ("hf-cb", "scls-cb", {"sampling": False, "page_size": 64, "num_blocks": 128, "max_batch_tokens": 256,
                              "memory_share": 0.8, "poll_s": 0.01, "kv_padding_tokens": 32, "cuda_graphs": "auto"}),
        ("fake", "scls-cb", {"decode_s": 0.001, "prefill_s_per_token": 1e-07, "vocab": 300, "max_natural": 9,
                             "kv_bytes_per_token": 99, "batching": "static", "grammar": False, "max_rows": 4,
                             "kv_reuse": False}),
    ],
)
def test_the_command_line_the_daemon_spawns_a_worker_with_reads_back_typed(
        engine: str, policy: str, options: dict[str, Any]) -> None:
    raw: dict[str, Any] = {"scheduler": {"policy": policy}, "workers": {"engine": engine, "options": options}}
    if engine == "fake":
        raw["model"] = {"name": "fake"}
    cfg = C.from_dict(raw)
    sup = Supervisor(cfg, "/tmp", None, lambda wid: [], lambda wid, why: None, lambda wid: None)
    cmd = sup.command("w0", 0)
    args = wm.build_parser().parse_args(cmd[cmd.index("--connect"):])
    assert args.engine == engine
    opts = wm.engine_options(args)
    for key, value in options.items():
        assert opts[key] == parse_option(key, value), key
    if "graph_batch_sizes" in options:
        assert opts["graph_batch_sizes"] == (1, 2, 4) and opts["graph_cache_tokens"] == (256, 512)


def test_the_engines_take_typed_values_and_their_text_alike() -> None:
    assert as_switch("static_cache", "auto", True) is True and as_switch("static_cache", "auto", False) is False
    assert as_switch("cuda_graphs", "false", True) is False and as_switch("cuda_graphs", True, False) is True
    assert as_switch("static_buckets", False, True) is False
    assert parse_sizes("1,2,4", "graph_batch_sizes") == parse_sizes((1, 2, 4), "graph_batch_sizes") == (1, 2, 4)
    with pytest.raises(ValueError, match="static_cache"):
        as_switch("static_cache", "maybe", True)
    with pytest.raises(ValueError, match="graph_cache_tokens"):
        parse_sizes("1,a", "graph_cache_tokens")
