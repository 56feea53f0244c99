"""The deepspeed engine on the CPU, and what the daemon does for it (config, memory rules).

On the CPU these tests check the wrapper and its integration (``deepspeed.init_inference``
around the transformers model, the hf slice loop through it, the repairs the wrapper
makes), not DeepSpeed's kernels: without kernel injection DeepSpeed runs transformers'
own modules. tests/gpu/ runs the CUDA side where a GPU exists.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from sclsd import models  # noqa: E402
from sclsd.protocol import BatchMsg, BatchRequest  # noqa: E402
from worker.engines import create_engine  # noqa: E402
from worker.engines import deepspeed as ds_engine  # noqa: E402

GEN = 16
REPO = Path(__file__).resolve().parents[2]


def _has_deepspeed() -> bool:
    try:
        ds_engine.import_deepspeed("cpu")
    except ds_engine.DeepSpeedUnavailableError:
        return False
    return True


needs_deepspeed = pytest.mark.skipif(
    not _has_deepspeed(), reason="deepspeed is not installed (pip install 'sclsd[deepspeed]')"
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (7, 30, 1, 15)]


@pytest.fixture(scope="module")
def pair() -> dict[str, tuple]:
    """(hf, deepspeed) engines on tiny-random per dtype, built once (each loads in < 1 s)."""
    return {}


def engines(pair: dict[str, tuple], dtype: str) -> tuple:
    if dtype not in pair:
        pair[dtype] = (
            create_engine("hf", "tiny-random", threads=1, dtype=dtype),
            create_engine("deepspeed", "tiny-random", threads=1, dtype=dtype),
        )
    return pair[dtype]


def req(rid: object, ids: list[int], max_new: int = GEN, **kw: object) -> BatchRequest:
    kw.setdefault("temperature", 0.0)
    return BatchRequest(rid=str(rid), token_ids=list(ids), max_new_tokens=max_new, **kw)


def one_pass(engine, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    batch = BatchMsg(batch_id=1, slice_len=GEN,
                     requests=[req(i, p, ignore_eos=True, **kw) for i, p in enumerate(prompts)])
    outs, stats = engine.serve(batch)
    assert stats.iterations == GEN
    return [o.token_ids for o in outs]


def sliced(engine, prompts: list[list[int]], s: int, **kw: object) -> list[list[int]]:
    """Serve in slices of ``s`` as the daemon does: prompt + generated ids, by id."""
    gen: list[list[int]] = [[] for _ in prompts]
    bid = 0
    while any(len(g) < GEN for g in gen):
        live = [i for i in range(len(prompts)) if len(gen[i]) < GEN]
        reqs = [req(i, prompts[i] + gen[i], GEN - len(gen[i]), generated=len(gen[i]),
                    ignore_eos=True, **kw) for i in live]  # fmt: skip
        bid += 1
        outs, stats = engine.serve(BatchMsg(batch_id=bid, slice_len=s, requests=reqs))
        assert stats.iterations <= s
        for i, out in zip(live, outs, strict=True):
            gen[i] += out.token_ids
            assert out.finish_reason == ("length" if len(gen[i]) == GEN else None)
    return gen


# --------------------------------------------------------------------------- the engine


@needs_deepspeed
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_hf_left_padded(pair, prompts, dtype):
    """Greedy tokens of a left-padded batch equal hf's, token for token, in fp32 and bf16.

    On the CPU this checks the wrapper and the slice loop through it, not DeepSpeed's
    kernels. In bf16 it also checks that the wrapper puts the fp32 rotary buffers back:
    DeepSpeed's ``.bfloat16()`` rounds them, and the tokens then differ.
    """
    hf, ds = engines(pair, dtype)
    assert type(ds.model).__name__ == "InferenceEngine"  # served through DeepSpeed's wrapper
    ref = one_pass(hf, prompts)
    assert len({tuple(r) for r in ref}) == len(ref)  # a non-degenerate model
    assert one_pass(ds, prompts) == ref


@needs_deepspeed
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_request_resumed_across_slices_equals_hf(pair, prompts, dtype):
    """A request resumed across slices (its ids sent back, as the daemon does) gives hf's
    one-pass tokens. On the CPU: the wrapper and the integration, not DeepSpeed's kernels."""
    hf, ds = engines(pair, dtype)
    assert sliced(ds, prompts, 5) == one_pass(hf, prompts)


@needs_deepspeed
def test_resumed_by_re_prefill_without_kept_kv(prompts):
    """With KV reuse off every slice re-prefills prompt + generated ids (the paper's path);
    tokens still equal hf's. On the CPU: the wrapper and the integration only."""
    hf = create_engine("hf", "tiny-random", threads=1)
    ds = create_engine("deepspeed", "tiny-random", threads=1, kv_reuse=False)
    assert sliced(ds, prompts, 3) == one_pass(hf, prompts)


@needs_deepspeed
def test_slice_contract_early_stop_stats_and_sampling(pair, prompts):
    """At most S iterations, early stop, invalid tokens, per-row seeded sampling as hf's.
    On the CPU: the hf loop through the wrapper, not DeepSpeed's kernels."""
    hf, ds = engines(pair, "float32")
    reqs = [req("a", prompts[0], 2, ignore_eos=True), req("b", prompts[1], 5, ignore_eos=True),
            req("c", prompts[2], 1, ignore_eos=True)]  # fmt: skip
    outs, stats = ds.serve(BatchMsg(batch_id=7, slice_len=50, requests=reqs))
    assert [len(o.token_ids) for o in outs] == [2, 5, 1]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert stats.iterations == 5 and stats.invalid_tokens == 4 + 3 and stats.batch_size == 3
    assert stats.prefill_s > 0 and stats.decode_s > 0
    outs, stats = ds.serve(BatchMsg(batch_id=8, slice_len=3, requests=[req("d", prompts[1], 10)]))
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason is None and stats.iterations == 3
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 100, "seed": 42}
    sampled = one_pass(ds, prompts, **kw)
    assert sampled == one_pass(hf, prompts, **kw)
    assert sampled != one_pass(ds, prompts)


@needs_deepspeed
def test_bf16_weights_with_fp32_rotary_buffers(pair):
    """Parameters in the engine's dtype on its device; the rotary buffers stay fp32."""
    _, ds = engines(pair, "bfloat16")
    module = ds.model.module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    buffers = dict(module.named_buffers())
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    assert {b.device.type for b in buffers.values()} == {"cpu"}


@needs_deepspeed
def test_info_names_the_engine_and_deepspeed(pair):
    _, ds = engines(pair, "float32")
    info = ds.info()
    assert info.engine == "deepspeed" and info.model == "tiny-random"
    assert info.kv_bytes_per_token == 512  # Δ as hf reports it
    assert info.extra["deepspeed"] == ds_engine.VERIFIED_VERSION
    assert info.extra["kernel_inject"] is False


def test_kernel_inject_refused_on_cpu_before_loading(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not load when the options are refused")

    monkeypatch.setattr(models, "load_model", no_load)
    with pytest.raises(ValueError, match="needs CUDA"):
        create_engine("deepspeed", "tiny-random", kernel_inject=True)


def test_kernel_inject_given_as_text():
    """``sclsd-worker profile --opt kernel_inject=false`` hands the engine a string."""
    assert ds_engine.as_bool("kernel_inject", "false") is False
    assert ds_engine.as_bool("kernel_inject", "True") is True
    with pytest.raises(ValueError, match="true or false"):
        ds_engine.as_bool("kernel_inject", "maybe")


def test_kernel_inject_on_cuda_is_refused_with_the_reason():
    with pytest.raises(ValueError) as exc:
        ds_engine.check_kernel_inject(True, "cuda")
    assert str(exc.value) == ds_engine.KERNEL_INJECT_REFUSAL
    assert "rotary" in str(exc.value) and "K/V" in str(exc.value)
    ds_engine.check_kernel_inject(False, "cuda")  # off: nothing to refuse


def test_missing_deepspeed_is_one_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ds_engine.DeepSpeedUnavailableError, match=r"pip install 'sclsd\[deepspeed\]'"):
        create_engine("deepspeed", "tiny-random")


def test_worker_without_deepspeed_exits_with_one_line(tmp_path):
    """``sclsd-worker --engine deepspeed`` where deepspeed cannot be imported: exit 2, one
    ERROR line saying what to install, no traceback."""
    (tmp_path / "deepspeed.py").write_text("raise ImportError(\"No module named 'deepspeed'\")\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "worker.main", "--connect", f"ipc://{tmp_path}/w.ipc", "--id", "w0",
         "--engine", "deepspeed", "--model", "tiny-random"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start engine deepspeed" in errors[0], out.stderr
    assert "pip install 'sclsd[deepspeed]'" in errors[0]
    assert "Traceback" not in out.stderr


def test_deepspeed_is_imported_by_this_engine_only():
    """The daemon, the registry and this module import nothing of deepspeed until an engine is built."""
    code = ("import sys, sclsd.daemon.server, sclsd.bench.gpu_check, worker.engines, "
            "worker.engines.deepspeed; print('deepspeed' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dequantised_gguf_marker_is_cleared_and_packed_weights_refused():
    model = models.load_model("tiny-random")
    removed = []
    model.hf_quantizer = SimpleNamespace(remove_quantization_config=removed.append)
    ds_engine.clear_dequantised_marker(model)
    assert removed == [model]  # every weight a float: the marker goes
    model.hf_quantizer = SimpleNamespace(remove_quantization_config=removed.append)
    model.model.norm.weight = torch.nn.Parameter(torch.zeros(64, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(ValueError, match="stay quantized"):
        ds_engine.clear_dequantised_marker(model)
    assert len(removed) == 1


def test_placement_check_catches_a_wrong_dtype_or_buffer():
    model = models.load_model("tiny-random")
    kept = models.float_buffers(model, torch.bfloat16)
    assert set(kept) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    with pytest.raises(ValueError, match="parameter"):
        ds_engine.check_placement(model, torch.device("cpu"), torch.bfloat16, kept)
    model.bfloat16()  # what DeepSpeed's cast does: the rotary buffers go to bf16 too
    with pytest.raises(ValueError, match="inv_freq"):
        ds_engine.check_placement(model, torch.device("cpu"), torch.bfloat16, kept)
    models.restore_buffers(model, kept)
    ds_engine.check_placement(model, torch.device("cpu"), torch.bfloat16, kept)


@pytest.mark.slow
@needs_deepspeed
def test_smollm2_greedy_equals_hf_including_a_resumed_request(monkeypatch):
    """SmolLM2 (GGUF, flagged quantized by transformers, dequantised): greedy tokens equal
    hf's in one pass and resumed across slices. On the CPU: the wrapper and the integration,
    not DeepSpeed's kernels."""
    hf = create_engine("hf", "smollm2-135m-instruct", threads=2)
    ref_prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30], [1, 4093, 28, 1045, 28]]
    ref = one_pass(hf, ref_prompts)
    # The deepspeed engine wraps the very model hf served (as loaded, quantization flag
    # included), which spares a second 18-s GGUF dequantisation.
    loaded, hf.model = hf.model, None
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    ds = create_engine("deepspeed", "smollm2-135m-instruct", threads=2)
    assert ds.model.module is loaded
    assert getattr(ds.model.module, "hf_quantizer", None) is None  # the marker was cleared
    assert one_pass(ds, ref_prompts) == ref
    assert sliced(ds, ref_prompts, 6) == ref


# --------------------------------------------------------------------------- daemon side


def test_config_memory_and_kernel_inject():
    from sclsd import config as C

    assert C.from_dict({}).scheduler.memory == "kv"
    assert C.from_dict({"scheduler": {"memory": "rules"}}).scheduler.memory == "rules"
    with pytest.raises(C.ConfigError, match="scheduler.memory"):
        C.from_dict({"scheduler": {"memory": "paged"}})
    ds = {"engine": "deepspeed"}
    static = {"policy": "scls"}  # deepspeed serves static batches: the static policy
    assert C.from_dict({"scheduler": static, "workers": {**ds, "options": {"kernel_inject": False}}})
    for workers, why in [
        ({**ds, "options": {"kernel_inject": True}}, "needs CUDA"),
        ({**ds, "device": "cuda", "options": {"kernel_inject": True}}, "not supported"),
        ({**ds, "options": {"kernel_inject": "yes"}}, "true or false"),
        ({"engine": "hf", "options": {"kernel_inject": False}}, "only the deepspeed engine"),
    ]:
        with pytest.raises(C.ConfigError, match=why) as exc:
            C.from_dict({"scheduler": static, "workers": workers})
        assert exc.value.key == "workers.options.kernel_inject"


def test_config_accepts_the_shipped_random_models():
    from sclsd import config as C

    for name in ("random:llama2-7b", "random:LLaMA2-13B"):
        assert C.from_dict({"model": {"name": name}}).model.name == name
    with pytest.raises(C.ConfigError, match="model.name"):
        C.from_dict({"model": {"name": "random:llama2-70b"}})


def test_daemon_memory_rules_or_kv():
    """``memory = "rules"`` judges by the rule table whatever the workers report; ``kv`` by
    the tightest worker's Δ and M_ava."""
    from sclsd import protocol as P
    from sclsd.core.memory import KVMemory, RuleTable
    from sclsd.core.profiles import load_profile
    from sclsd.daemon.cost import DaemonCost

    reg = P.Register(worker_id="w0", engine="deepspeed", model="m", device="cpu",
                     kv_bytes_per_token=1000, mem_available=10**6, pid=1)  # fmt: skip
    hf_profile = load_profile("cpu-smollm2-135m")
    rules = DaemonCost(hf_profile, 0.9, memory_model="rules")
    rules.on_register(reg)
    assert rules.inner.memory == RuleTable.deepspeed()  # Algorithm 2: the profile has no table
    assert not rules.oom(28, 300, 128) and rules.oom(29, 300, 128) and rules.oom(13, 1000, 128)
    own = DaemonCost(load_profile("a100-llama2-13b-ds"), 0.9, memory_model="rules")
    assert own.inner.memory == load_profile("a100-llama2-13b-ds").rules
    kv = DaemonCost(load_profile("a100-llama2-13b-ds"), 0.9, memory_model="kv")
    kv.on_register(reg)
    assert kv.inner.memory == KVMemory(1000, 10**6, 0.9)  # the table is not used
    assert kv.oom(8, 100, 20) and not kv.oom(7, 100, 20)  # 8 · 120 · 1000 > 0.9 · 10^6
    with pytest.raises(ValueError, match="memory model"):
        DaemonCost(hf_profile, 0.9, memory_model="paged")


def test_shipped_llama2_architectures():
    """random:llama2-7b / -13b: LLaMA2's dimensions (Δ as the paper's profiles use), the
    vocabulary of the tokenizer that serves them, built on the device asked for."""
    from sclsd.bench.gpu_check import param_count

    c7, c13 = models.load_config("random:llama2-7b"), models.load_config("random:llama2-13b")
    assert (c7.num_hidden_layers, c7.hidden_size, c7.intermediate_size) == (32, 4096, 11008)
    assert (c13.num_hidden_layers, c13.hidden_size, c13.intermediate_size) == (40, 5120, 13824)
    assert models.kv_bytes_per_token(c13, "float16") == 819_200  # a100-llama2-13b-*.json
    assert models.kv_bytes_per_token(c7, "float16") == 524_288
    assert c7.vocab_size == c13.vocab_size == models.SMOLLM2_VOCAB
    # Built on the meta device: no memory, and the count matches the closed form.
    m = models.load_model("random:llama2-7b", device="meta", dtype="float16")
    assert next(m.parameters()).device.type == "meta"
    assert {p.dtype for p in m.parameters()} == {torch.float16}
    assert sum(p.numel() for p in m.parameters()) == param_count(c7)
    # LLaMA2-7B has 6,738,415,616 parameters with its 32,000-token vocabulary.
    assert param_count(c7) - 2 * (models.SMOLLM2_VOCAB - 32000) * 4096 == 6_738_415_616


# --------------------------------------------------------------------------- gpu-check planning
