"""fp8 linears (Transformer Engine, torchao float8) and NVIDIA apex (fused
norms, FusedAdam): the module swaps and the config errors, on the CPU.

Transformer Engine and apex are replaced by stand-in modules in sys.modules
that record what they were asked to build; torchao float8 is the real one
(its conversion runs on the meta device). The numerics are GPU work:
scripts/gpu_check.sh's last step."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from giantmodel.config import ConfigError, load_config
from giantmodel.core.optim import build_adamw
from giantmodel.models.common.layers import RMSNorm
from giantmodel.models.registry import build_model, init_weights
from giantmodel.parallel import accel
from giantmodel.parallel.accel import Accelerations, plan_accelerations

TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vocab_size=96", "model.max_seq_len=32",
        "train.seq_len=16"]
BLOCK_LINEARS = {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}


def _config(*overrides: str):
    return load_config(overrides=TINY + list(overrides))


def _model(cfg):
    model = build_model(cfg.model)  # meta, as parallelize receives it
    return model, [model.layers[k] for k in model.layers]


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, key, words", [
    (["precision=fp8", "parallel.tp=2"], "precision", "parallel.tp=1"),
    (["train.fp8_recipe=delayed"], "train.fp8_recipe", "precision is fp32"),
    (["optim.impl=apex", "parallel.zero=3"], "optim.impl", "DTensors"),
    (["train.norm_impl=apex", "parallel.tp=2", "parallel.sp=true"], "train.norm_impl", "sp"),
])
def test_config_refuses_what_the_layout_cannot_take(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        _config(*overrides)
    assert err.value.key == key and words in str(err.value)
    assert "\n" not in str(err.value)


def test_device_and_packages_are_checked_before_any_process_group(monkeypatch):
    cfg = _config("precision=fp8")
    with pytest.raises(ConfigError, match="needs a CUDA GPU .*on cpu"):
        plan_accelerations(cfg, torch.device("cpu"))
    cuda = torch.device("cuda")  # a stand-in: nothing touches a device
    monkeypatch.setattr(accel, "_capability", lambda d: (8, 0))
    with pytest.raises(ConfigError, match="8.9 or newer .* is 8.0"):
        plan_accelerations(cfg, cuda)
    monkeypatch.setattr(accel, "_capability", lambda d: (9, 0))
    installed = set()
    monkeypatch.setattr(accel, "_importable", lambda name: name in installed)
    with pytest.raises(ConfigError, match="neither is installed") as err:
        plan_accelerations(cfg, cuda)
    assert err.value.key == "precision"
    with pytest.raises(ConfigError, match="Transformer Engine recipe") as err:
        plan_accelerations(_config("precision=fp8", "train.fp8_recipe=delayed"), cuda)
    assert err.value.key == "train.fp8_recipe"
    installed.add("torchao.float8")
    plan = plan_accelerations(cfg, cuda, fsdp=True)
    assert (plan.fp8, plan.recipe, plan.fsdp_float8_all_gather) == ("torchao", "tensorwise", True)
    installed.add("transformer_engine.pytorch")
    plan = plan_accelerations(cfg, cuda)
    assert (plan.fp8, plan.recipe) == ("te", "current")
    plan = plan_accelerations(_config("precision=fp8", "train.fp8_recipe=rowwise"), cuda, fsdp=True)
    assert (plan.fp8, plan.fsdp_float8_all_gather) == ("torchao", False)  # tensorwise only
    for overrides, key in ((["optim.impl=apex"], "optim.impl"),
                           (["train.norm_impl=apex"], "train.norm_impl")):
        with pytest.raises(ConfigError, match="github.com/NVIDIA/apex") as err:
            plan_accelerations(_config(*overrides), cuda)
        assert err.value.key == key
        with pytest.raises(ConfigError, match="CUDA only"):
            plan_accelerations(_config(*overrides), torch.device("cpu"))


# ------------------------------------------------------ stand-in packages
class _Recorder(nn.Module):
    """A stand-in TE / apex module: records its arguments, holds parameters
    of the same names and shapes as what it replaces."""

    built: list = []

    def __init__(self, *args, **kwargs):
        super().__init__()
        _Recorder.built.append((type(self).__name__, args, kwargs))


@pytest.fixture
def fake_te(monkeypatch):
    entered = []

    class Linear(_Recorder):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, params_dtype=params_dtype, device=device)
            self.weight = nn.Parameter(torch.empty(o, i, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.empty(o, device=device)) if bias else None

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        entered.append(recipe)
        yield

    recipe = types.SimpleNamespace(
        Format=types.SimpleNamespace(HYBRID="hybrid"),
        DelayedScaling=lambda **kw: ("delayed", kw), Float8CurrentScaling=lambda **kw: ("current", kw))
    te = types.ModuleType("transformer_engine.pytorch")
    te.Linear, te.autocast = Linear, autocast
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.pytorch, root.common = te, common
    for name, mod in (("transformer_engine", root), ("transformer_engine.pytorch", te),
                      ("transformer_engine.common", common)):
        monkeypatch.setitem(sys.modules, name, mod)
    _Recorder.built = []
    return types.SimpleNamespace(te=te, entered=entered)


@pytest.fixture
def fake_apex(monkeypatch):
    made = []

    class MixedFusedRMSNorm(_Recorder):
        def __init__(self, shape, eps):
            super().__init__(shape, eps=eps)
            self.weight = nn.Parameter(torch.empty(shape))

        def forward(self, x):
            return x.float() * self.weight.float()  # fp32 out, as a mixed kernel may give

    class FusedAdam:
        def __init__(self, groups, **kwargs):
            made.append((groups, kwargs))

    norm = types.ModuleType("apex.normalization")
    norm.MixedFusedRMSNorm = MixedFusedRMSNorm
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = FusedAdam
    root = types.ModuleType("apex")
    root.normalization, root.optimizers = norm, optimizers
    for name, mod in (("apex", root), ("apex.normalization", norm), ("apex.optimizers", optimizers)):
        monkeypatch.setitem(sys.modules, name, mod)
    _Recorder.built = []
    return made


# ------------------------------------------------------------------ swaps
def test_te_linears_replace_the_blocks_linears_under_te_autocast(fake_te):
    cfg = _config("precision=fp8")
    model, blocks = _model(cfg)
    names = [n for n, _ in model.named_parameters()]
    Accelerations(fp8="te", recipe="current").apply(model, blocks)
    for block in blocks:
        for sub in BLOCK_LINEARS:
            assert isinstance(block.get_submodule(sub), fake_te.te.Linear), sub
    assert type(model.output) is nn.Linear  # the head stays in high precision
    assert [n for n, _ in model.named_parameters()] == names  # init and checkpoints unchanged
    args = [a for kind, a, _ in _Recorder.built if kind == "Linear"]
    assert len(args) == 7 * len(blocks) and (64, 64) in args
    assert all(kw["device"] == "meta" and kw["params_dtype"] == torch.float32
               for kind, _, kw in _Recorder.built)
    # Weights drawn under the same names: equal to the plain model's.
    plain = init_weights(build_model(cfg.model), cfg.model, seed=5)
    init_weights(model, cfg.model, seed=5)
    assert torch.equal(model.layers["0"].attention.wq.weight, plain.layers["0"].attention.wq.weight)

    prec = Accelerations(fp8="te", recipe="delayed").precision("fp8", "cpu")
    with prec.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert fake_te.entered[-1][0] == "delayed" and fake_te.entered[-1][1]["fp8_format"] == "hybrid"
    assert prec.mode == "fp8" and prec.scale == 1.0
    # Older TE: only fp8_autocast(fp8_recipe=...).
    del fake_te.te.autocast
    fake_te.te.fp8_autocast = lambda enabled, fp8_recipe: contextlib.nullcontext(
        fake_te.entered.append(fp8_recipe))
    with Accelerations(fp8="te", recipe="current").precision("fp8", "cpu").autocast():
        pass
    assert fake_te.entered[-1][0] == "current"


@pytest.mark.parametrize("recipe, all_gather", [("tensorwise", True), ("rowwise", False)])
def test_torchao_float8_converts_the_blocks_linears(recipe, all_gather):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    cfg = _config("precision=fp8")
    model, blocks = _model(cfg)
    names = [n for n, _ in model.named_parameters()]
    Accelerations(fp8="torchao", recipe=recipe, fsdp_float8_all_gather=all_gather).apply(model, blocks)
    swapped = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(swapped) == 7 * len(blocks) and not any(n == "output" for n in swapped)
    lin = blocks[0].attention.wq
    assert lin.config.enable_fsdp_float8_all_gather is all_gather
    scaling = str(lin.config.cast_config_weight.scaling_granularity).lower()
    assert ("axiswise" if recipe == "rowwise" else "tensorwise") in scaling
    assert [n for n, _ in model.named_parameters()] == names


def test_float8_eligibility_skips_odd_sides_and_routers():
    assert accel._fp8_eligible("attention.wq", nn.Linear(64, 32, device="meta"))
    assert not accel._fp8_eligible("attention.wq", nn.Linear(64, 40 + 1, device="meta"))
    assert not accel._fp8_eligible("feed_forward.gate", nn.Linear(64, 32, device="meta"))


def test_apex_norms_replace_rmsnorm_and_keep_the_input_dtype(fake_apex):
    cfg = _config("train.norm_impl=apex")
    model, blocks = _model(cfg)
    names = [n for n, _ in model.named_parameters()]
    Accelerations(apex_norms=True).apply(model, blocks)
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "MixedFusedRMSNorm"]
    assert len(norms) == 2 * len(blocks) + 1  # two per block and the final one
    assert [n for n, _ in model.named_parameters()] == names
    assert all(kw == {"eps": cfg.model.norm_eps} for _, _, kw in _Recorder.built)
    norm = model.norm.to_empty(device="cpu")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16


def test_apex_fused_adam(fake_apex, monkeypatch):
    cfg = _config("optim.impl=apex", "optim.weight_decay=0.05")
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]
    build_adamw(params, cfg.optim, "cuda")
    groups, kwargs = fake_apex[-1]
    assert kwargs["adam_w_mode"] is True and kwargs["lr"] == cfg.optim.lr
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # matrices decay, vectors not
    with pytest.raises(ConfigError, match="plain CUDA tensors"):
        build_adamw(params, cfg.optim, "cpu")
    monkeypatch.setitem(sys.modules, "apex.optimizers", None)  # PyPI's apex: no optimizers
    with pytest.raises(ConfigError, match="github.com/NVIDIA/apex"):
        build_adamw(params, cfg.optim, "cuda")
