"""LoRA modules: PEFT-compatible initialisation and export, HF parity after
training, tensor-parallel adapters, QLoRA on CPU, adapter-only state, the
planner's LoRA memory, and one-line errors for bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from giantmodel.config import load_config
from giantmodel.config.errors import ConfigError
from giantmodel.models.lora import (
    LoRALinear,
    apply_lora,
    freeze_base,
    is_lora_param,
    lora_init_tensor,
    merge_lora_state,
    save_peft_adapter,
)

TOL = 1e-5


def _hf_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                                   max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_merged_and_peft_exports_match_giantmodel_after_training(tmp_path):
    """Train adapters a few steps, then giantmodel's logits, HF with the merged
    export and HF + peft with the adapter export agree within 1e-5 (fp32)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from giantmodel.models.hf import from_hf, save_hf

    base = _hf_llama(tmp_path)
    model = from_hf(base).train()
    apply_lora(model, ["all_linear"], rank=4, alpha=8.0)
    for name, p in model.named_parameters():
        if is_lora_param(name):
            with torch.no_grad():
                p.copy_(lora_init_tensor(name, p.shape, "kaiming", seed=0))
    freeze_base(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(is_lora_param(n) for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_param(n))
    model.eval()
    tokens = torch.randint(0, 128, (2, 24), generator=gen)
    with torch.no_grad():
        ours = model(tokens)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert any(v.abs().max() > 0 for k, v in state.items() if ".lora_B." in k)  # it trained
    save_hf(merge_lora_state(state, 8.0 / 4), model.cfg, tmp_path / "merged")
    save_peft_adapter(state, tmp_path / "adapter", targets=["all_linear"], rank=4, alpha=8.0,
                      base_model=str(base))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        a, b = merged(tokens).logits, with_adapter(tokens).logits
    assert (ours - a).abs().max().item() < TOL
    assert (ours - b).abs().max().item() < TOL


def test_init_is_peft_like_and_layout_independent():
    m = LoRALinear(48, 32, rank=4, alpha=8.0)
    a = lora_init_tensor("layers.0.attention.wq.lora_A.weight", (4, 48), "kaiming", seed=3)
    b = lora_init_tensor("layers.0.attention.wq.lora_B.weight", (32, 4), "kaiming", seed=3)
    assert torch.equal(b, torch.zeros(32, 4))
    assert a.abs().max() <= 1 / math.sqrt(48) and a.std() > 0.5 / math.sqrt(3 * 48)
    assert torch.equal(a, lora_init_tensor("layers.0.attention.wq.lora_A.weight", (4, 48),
                                           "kaiming", seed=3))
    g = lora_init_tensor("layers.0.attention.wq.lora_A.weight", (4, 4096), "gaussian", seed=3)
    assert abs(g.std().item() - 1 / 4) < 0.01
    # B = 0: the adapted layer starts as the base layer.
    with torch.no_grad():
        m.weight.copy_(torch.randn(32, 48))
        m.lora_A.weight.copy_(a)
        m.lora_B.weight.zero_()
    x = torch.randn(5, 48)
    assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight))


def _tp_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from giantmodel.objectives.lora_tp import lora_style

    def make():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(LoRALinear(16, 24, 4, 8.0, bias=True),
                                     LoRALinear(24, 16, 4, 8.0, bias=True))
        for m in layers:
            for p in m.parameters():
                torch.nn.init.normal_(p, std=0.3)
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)
        return layers

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    ref = make()
    y = ref(x)
    y.square().sum().backward()
    mesh = init_device_mesh("cpu", (world,))
    m = make()
    parallelize_module(m, mesh, {"0": lora_style(m[0], ColwiseParallel()),
                                 "1": lora_style(m[1], RowwiseParallel())})
    y2 = m(x)
    y2.square().sum().backward()
    out = {"out": (y - y2).abs().max().item() / y.abs().max().item()}
    for (n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters()):
        if p.grad is not None:
            assert q.grad.placements == q.placements, (n, q.grad.placements, q.placements)
            out[n] = ((p.grad - q.grad.full_tensor()).abs().max() / p.grad.abs().max()).item()
            out[n + ".placement"] = repr(q.placements[0])
    return out


def test_tensor_parallel_adapters_match_one_process():
    """Column-parallel base: B sharded by rows, A replicated; row-parallel
    base: A sharded by columns, B replicated. Output and every adapter
    gradient match the unsharded layers, and gradients keep the parameter's
    placement (no partial sums left for the optimizer)."""
    from giantmodel.testing import run_ranks

    res = run_ranks(_tp_case, 2, timeout=120)[0]
    assert res["0.lora_A.weight.placement"] == "Replicate()"
    assert res["0.lora_B.weight.placement"] == "Shard(dim=0)"
    assert res["1.lora_A.weight.placement"] == "Shard(dim=1)"
    assert res["1.lora_B.weight.placement"] == "Replicate()"
    for k, v in res.items():
        if not k.endswith("placement"):
            assert v < 1e-5, (k, v)


def test_qlora_nf4_base_on_cpu():
    pytest.importorskip("torchao")
    from giantmodel.models.lora import quantize_base_nf4

    torch.manual_seed(0)
    plain = LoRALinear(128, 256, rank=4, alpha=8.0)
    torch.nn.init.normal_(plain.weight, std=0.05)
    torch.nn.init.normal_(plain.lora_B.weight, std=0.05)
    q = LoRALinear(128, 256, rank=4, alpha=8.0)
    q.load_state_dict(plain.state_dict())
    holder = torch.nn.Module()
    holder.layer = q
    freeze_base(holder)
    assert quantize_base_nf4(holder) == 1
    x = torch.randn(8, 128)
    y = q(x)
    y.sum().backward()
    assert q.lora_A.weight.grad is not None and q.weight.grad is None
    rel = ((y - plain(x)).norm() / plain(x).norm()).item()
    assert rel < 0.15  # 4-bit base: close, not equal
    assert torch.allclose(y, torch.nn.functional.linear(x, q.base_weight()) +
                          q.lora_B(q.lora_A(x)) * q.scaling, atol=1e-5)


def test_adapter_only_state_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp

    from giantmodel.checkpoint.manager import dcp_load
    from giantmodel.checkpoint.state import ModelState

    def model():
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
        m.layers["0"].attention = torch.nn.Module()
        m.layers["0"].attention.wq = torch.nn.Linear(8, 8, bias=False)
        apply_lora(m, ["q_proj"], 2, 4.0)
        return m

    a = model()
    saved = ModelState([a], is_lora_param)
    assert sorted(saved.state_dict()) == ["layers.0.attention.wq.lora_A.weight",
                                          "layers.0.attention.wq.lora_B.weight"]
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    b = model()
    base_before = b.layers["0"].attention.wq.weight.clone()
    dcp_load({"model": ModelState([b], is_lora_param)}, tmp_path / "ck")
    for n in ("lora_A", "lora_B"):
        assert torch.equal(getattr(b.layers["0"].attention.wq, n).weight,
                           getattr(a.layers["0"].attention.wq, n).weight)
    assert torch.equal(b.layers["0"].attention.wq.weight, base_before)


@pytest.mark.parametrize("override, key, needle", [
    ("lora.rank=0", "lora.rank", "must be a positive integer"),
    ("lora.rank=-4", "lora.rank", "must be a positive integer"),
    ("lora.targets=[q_proj,qkv]", "lora.targets[1]", "'qkv' matches no module"),
    ("lora.targets=[]", "lora.targets", "name at least one module"),
])
def test_bad_lora_settings_fail_with_one_line(override, key, needle):
    cfg = load_config(overrides=[override], validate=False)
    with pytest.raises(ConfigError) as e:
        cfg.lora.validate(cfg.model.arch)
    assert key in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)
    gpt = load_config(overrides=["lora.targets=[up_proj]"], validate=False)
    with pytest.raises(ConfigError, match="'up_proj' matches no module of a gpt block"):
        gpt.lora.validate("gpt")


def test_planner_counts_lora_states():
    """LoRA keeps the frozen base's parameters but gradients and optimizer
    state only for the adapters; QLoRA shrinks the adapted base weights."""
    from giantmodel.planner.layout import Cluster, resolve_layout
    from giantmodel.planner.memory import memory_report

    common = ["model.hidden_size=1024", "model.num_layers=8", "model.num_heads=8",
              "model.num_kv_heads=8", "model.ffn_hidden_size=2816", "model.vocab_size=32000",
              "model.max_seq_len=1024", "train.seq_len=1024", "train.micro_batch_size=1",
              "train.global_batch_size=1", "precision=bf16", "lora.rank=8",
              "lora.targets=[all_linear]"]
    full = load_config(overrides=common)
    lora = load_config(overrides=common + ["objective=lora"])
    cluster = Cluster(1, 1)
    f = memory_report(full.model, resolve_layout(full, cluster), None).ranks[0].components
    layout = resolve_layout(lora, cluster)
    assert layout.lora_rank == 8 and "attention.wq" in layout.lora_paths
    lo = memory_report(lora.model, layout, None).ranks[0].components
    n_base = full.model.num_params()
    n_adapters = 8 * (8 * (3 * (1024 + 1024) + 1024 + 1024 + 2 * (1024 + 2816) + 2816 + 1024))
    assert f["optimizer"] == 8 * n_base and f["grads"] == 4 * n_base
    assert lo["grads"] == 4 * n_adapters and lo["optimizer"] == 8 * n_adapters
    # under bf16 training the frozen base is kept in bf16, the adapters in fp32
    assert lo["params"] == 2 * n_base + 4 * n_adapters
    lora.lora.quantize_base = "nf4"
    q = memory_report(lora.model, resolve_layout(lora, cluster), None).ranks[0].components
    assert q["params"] < 0.6 * lo["params"]


def test_cli_refuses_bad_lora_before_training(capsys):
    from giantmodel.cli import main

    assert main(["train", "objective=lora", "lora.rank=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: lora.rank") and "\n" not in err
    assert main(["train", "objective=lora", "lora.targets=[q_pro]"]) == 2
    assert "'q_pro' matches no module" in capsys.readouterr().err


def test_plan_and_estimate_follow_the_lora_keys():
    """Every layout `giantmodel plan` searches carries the adapters (rank,
    targets); a frozen base keeps no linear inputs nor RMSNorm products for
    its weights; foreach AdamW's step temporary counts trained elements only."""
    from giantmodel.planner.hardware import get_profile
    from giantmodel.planner.layout import Cluster, resolve_layout
    from giantmodel.planner.memory import layer_activation_bytes, memory_report
    from giantmodel.planner.search import apply_layout, search

    common = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8",
              "model.num_kv_heads=8", "model.ffn_hidden_size=1408", "model.vocab_size=32000",
              "model.max_seq_len=512", "train.seq_len=512", "train.micro_batch_size=1",
              "train.global_batch_size=4", "precision=fp32"]
    lora = load_config(overrides=common + ["objective=lora", "lora.rank=16",
                                           "lora.targets=[q_proj,v_proj]"])
    full = load_config(overrides=common)
    hw, cluster = get_profile("cpu"), Cluster(1, 2)
    cands = search(lora, hw, cluster, time_budget_s=20)
    assert cands
    for c in cands:
        assert c.layout.lora_rank == 16
        assert c.layout.lora_paths == ("attention.wq", "attention.wv")
        again = resolve_layout(apply_layout(lora, c.layout), cluster)
        assert memory_report(lora.model, again, hw).peak_bytes_per_rank == c.memory.peak_bytes_per_rank
    one = Cluster(1, 1)
    lo_layout, full_layout = resolve_layout(lora, one), resolve_layout(full, one)
    acts = layer_activation_bytes(lora.model, "fp32", "none", 1, 512,
                                  lora=(16, lo_layout.lora_paths))
    assert "feed_forward.input" not in acts and "feed_forward.w2_input" not in acts
    assert "attention_norm.normed" not in acts and acts["attention.input"] == 512 * 4 * 512
    assert acts["attention.wq.lora_ax"] == 512 * 4 * 16
    lo = memory_report(lora.model, lo_layout, hw).ranks[0].components
    fu = memory_report(full.model, full_layout, hw).ranks[0].components
    assert lo["activations"] < 0.8 * fu["activations"]
    assert "head.input" not in str(lo) and lo["optimizer_step"] == 0
    # foreach holds sqrt(v) for all trained elements once backward has freed
    # the (here few) activations; fused (auto, on CPU and CUDA) holds none
    short = load_config(overrides=common + ["train.seq_len=16", "train.global_batch_size=1",
                                            "optim.impl=foreach"])
    layout = resolve_layout(short, one)
    fu = memory_report(short.model, layout, hw).ranks[0].components
    assert 0.45 * fu["optimizer"] < fu["optimizer_step"] <= 0.5 * fu["optimizer"]
    auto = resolve_layout(load_config(overrides=common + ["train.seq_len=16"]), one)
    assert memory_report(short.model, auto, hw).ranks[0].components["optimizer_step"] == 0
    gpu = memory_report(short.model, auto, get_profile("h100-sxm")).ranks[0].components
    assert gpu["optimizer_step"] == 0


def test_throughput_model_knows_the_frozen_base():
    """A frozen base has no weight gradients; only the adapters are reduced
    over dp and updated by the optimizer."""
    from giantmodel.planner.hardware import get_profile
    from giantmodel.planner.layout import Cluster, resolve_layout
    from giantmodel.planner.perf import estimate_time

    common = ["model.hidden_size=4096", "model.num_layers=8", "model.num_heads=32",
              "model.num_kv_heads=32", "model.ffn_hidden_size=11008", "model.vocab_size=32000",
              "model.max_seq_len=2048", "train.seq_len=2048", "train.micro_batch_size=1",
              "train.global_batch_size=8", "precision=bf16", "parallel.dp=8"]
    full = load_config(overrides=common)
    lora = load_config(overrides=common + ["objective=lora", "lora.targets=[q_proj,v_proj]"])
    hw, cluster = get_profile("h100-sxm"), Cluster(1, 8)
    f = estimate_time(full.model, resolve_layout(full, cluster), hw, cluster, 8)
    lo = estimate_time(lora.model, resolve_layout(lora, cluster), hw, cluster, 8)
    assert 0.6 < lo.stage_s[0] / f.stage_s[0] < 0.85   # backward: input gradients only
    assert lo.breakdown["optimizer"] < 0.01 * f.breakdown["optimizer"]
    assert lo.breakdown["dp_comm_exposed"] < 0.1 * f.breakdown["dp_comm_exposed"]
    # model FLOPs: 4 per frozen weight and token (forward, input gradient), not 6
    flops = [r.tflops_per_gpu * r.step_s for r in (lo, f)]
    assert 0.6 < flops[0] / flops[1] < 0.7


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_selective_recompute_gives_the_adapters_the_same_gradients(arch):
    """Selective recompute replays a cached matmul output in backward: an
    adapter added into it in place was counted twice there (LLaMA: wrong
    gradients, silently; GPT's biased linears: an error)."""
    from test_planner_activations import tiny

    from giantmodel.config.schema import JobConfig
    from giantmodel.core.loss import cross_entropy_sum
    from giantmodel.objectives.lora import LoRA
    from giantmodel.parallel.objective import StageSpec
    from giantmodel.parallel.recompute import apply_recompute

    def grads(mode):
        cfg = JobConfig(model=tiny(arch, num_layers=2, vocab_size=4096), objective="lora")
        cfg.lora.rank, cfg.lora.targets = 4, ["all_linear"]
        obj = LoRA.from_config(cfg)
        model = obj.build(StageSpec())
        apply_recompute(model, {f"layers.{k}": mode for k in model.layers})
        obj.init_weights(model, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at zero, which would hide the error
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen)
        cross_entropy_sum(model(ids), ids)[0].backward()
        return {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                for n, p in model.named_parameters() if p.grad is not None}

    ref, sel = grads("none"), grads("selective")
    assert ref.keys() == sel.keys() and ref
    for n in ref:
        torch.testing.assert_close(sel[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_all_linear_on_an_moe_model_adapts_attention_and_dense_layers_only():
    """Routed experts are stacked 3-D weights, not linears: all_linear adapts
    the attention of every block and the feed-forward of the dense ones."""
    from giantmodel.config import load_config
    from giantmodel.models.lora import LoRALinear, apply_lora
    from giantmodel.models.registry import build_model

    cfg = load_config("configs/moe/tiny.yaml", ["model.num_layers=2"])
    model = build_model(cfg.model, device="meta")
    done = apply_lora(model, ["all_linear"], rank=4, alpha=8)
    assert done and all(isinstance(model.get_submodule(p), LoRALinear) for p in done)
    assert any(".attention." in p for p in done)
    moe_blocks = [i for i, b in model.layers.items() if not hasattr(b.feed_forward, "w1")]
    assert moe_blocks, "the tiny MoE config has no MoE block"
    assert not any(p.startswith(f"layers.{i}.feed_forward") for i in moe_blocks for p in done)
    with pytest.raises(ValueError, match="routed experts cannot take adapters"):
        only_moe = build_model(cfg.model, device="meta")
        for i in list(only_moe.layers):
            if i not in moe_blocks:
                del only_moe.layers[i]
        apply_lora(only_moe, ["gate_proj"], rank=4, alpha=8)
