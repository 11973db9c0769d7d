"""The MoE layer: routers against transformers' own blocks, both expert paths
against a dense reference, capacity dropping, balance losses, the config's
checks and the MoE model's parameters, init and checkpointed bias."""

import math

import pytest
import torch
from torch import nn

from giantmodel.config import ConfigError, load_config
from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.core import compat
from giantmodel.models.common.moe import (
    STAT_DROPPED,
    STAT_FORWARDS,
    MoE,
    Router,
    balance_losses,
    moe_layers,
    update_expert_bias,
)
from giantmodel.models.registry import build_model, count_params, init_weights

H, F = 16, 24


def _moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, **kw})
    m = MoE(H, F, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.init_buffers()
    return m


def _dense_reference(m: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Every expert on every token, weighted by a dense [N, E] routing matrix."""
    flat = x.reshape(-1, H)
    route = m.router(flat)
    weights = route.weights if keep is None else route.weights * keep
    dense = torch.zeros(flat.shape[0], m.cfg.num_experts).scatter_add_(1, route.experts, weights)
    e = m.experts
    every = torch.stack([(nn.functional.silu(flat @ e.w1[i]) * (flat @ e.w3[i])) @ e.w2[i]
                         for i in range(m.cfg.num_experts)], dim=1)          # [N, E, H]
    out = (dense.unsqueeze(-1) * every).sum(1)
    if m.shared_experts is not None:
        shared = m.shared_experts(flat)
        if m.shared_experts_gate is not None:
            shared = torch.sigmoid(m.shared_experts_gate(flat)) * shared
        out = out + shared
    return out.view_as(x)


def _grads(m: MoE, x: torch.Tensor, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    m.zero_grad()
    x = x.clone().requires_grad_(True)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [x.grad] + [p.grad.clone() for p in m.parameters()]


def _grouped_mm_on_cpu() -> bool:
    """torch._grouped_mm exists and has a CPU kernel (torch's own loop)."""
    if not compat.has("grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 8),
                          offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


GROUPED_ON_CPU = _grouped_mm_on_cpu()


def _experts(num: int, impl: str, dtype: torch.dtype = torch.float32):
    """GroupedExperts of ``num`` experts with seeded N(0, 0.3) weights."""
    from giantmodel.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(H, F, num, impl=impl).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts
IMPLS = ["loop"] + (["grouped_mm"] if GROUPED_ON_CPU else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_paths_equal_the_dense_reference_with_gradients(impl):
    for kw in ({}, {"router": "sigmoid", "n_group": 4, "topk_group": 2, "num_shared_experts": 2,
                    "routed_scaling_factor": 2.5, "top_k": 3},
               {"norm_topk_prob": False, "num_shared_experts": 1, "shared_expert_gate": True}):
        m = _moe(experts_impl=impl, **kw)
        if m.router.expert_bias is not None:
            m.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
        x = torch.randn(3, 5, H)
        out, grads = _grads(m, x, m)
        ref, ref_grads = _grads(m, x, lambda t, m=m: _dense_reference(m, t))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not GROUPED_ON_CPU, reason="torch._grouped_mm has no CPU kernel here")
def test_grouped_path_gives_an_empty_expert_zero_rows_and_a_zero_gradient():
    """An expert no token chose still gets one aligned block of zero rows
    (sm100's kernel writes garbage into an empty group's weight gradient):
    every group the kernel sees is non-empty and starts aligned, the output
    equals the loop's, and the empty experts' weight gradients are zero."""

    experts = _experts(4, "grouped_mm", torch.bfloat16)
    counts = torch.tensor([0, 5, 0, 3, 2])       # experts 0 and 2 empty; 2 dropped rows
    x = torch.randn(10, H, dtype=torch.bfloat16)
    seen = []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append(offs.tolist())
        return real(a, b, offs=offs, **kw)

    outs, grads = [], []
    for impl in ("grouped_mm", "loop"):
        experts.impl = impl
        experts.zero_grad()
        torch._grouped_mm = spy
        try:
            y = experts(x, counts)
        finally:
            torch._grouped_mm = real
        y[:8].float().sum().backward()
        outs.append(y[:8].float())
        grads.append([p.grad.float() for p in (experts.w1, experts.w3, experts.w2)])
    sizes = [b - a for a, b in zip([0] + seen[0][:-1], seen[0])]
    assert all(s > 0 and s % 8 == 0 for s in sizes[:-1]) and sizes[-1] > 0, seen[0]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for g, r in zip(*grads):
        assert g[[0, 2]].abs().max() == 0 and r[[0, 2]].abs().max() == 0
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not GROUPED_ON_CPU, reason="torch._grouped_mm has no CPU kernel here")
def test_grouped_path_in_bf16_pads_groups_and_matches_the_loop():
    """bf16 groups start at multiples of 8 rows: the padded buffer must not
    change the result (and its rows past the groups stay finite)."""
    m = _moe(experts_impl="grouped_mm", capacity_factor=0.5)
    x = torch.randn(2, 13, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _grads(m, x, m)
        m.experts.impl = "loop"
        ref, ref_grads = _grads(m, x, m)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2)


def test_capacity_drops_the_lowest_weighted_and_counts_them():
    m = _moe(capacity_factor=0.5)
    m.train()
    x = torch.randn(4, 8, H)
    out = m(x)
    n, k, e = 32, 2, 8
    capacity = math.ceil(0.5 * n * k / e)
    route = m.router(x.reshape(-1, H))
    # reference keep mask: per expert, the `capacity` highest weights
    keep = torch.zeros(n, k, dtype=torch.bool)
    for i in range(e):
        tok, slot = torch.where(route.experts == i)
        best = route.weights[tok, slot].argsort(descending=True)[:capacity]
        keep[tok[best], slot[best]] = True
    torch.testing.assert_close(out, _dense_reference(m, x, keep), rtol=1e-5, atol=1e-5)
    dropped = int((~keep).sum())
    assert dropped > 0
    assert m.stats[e + STAT_DROPPED] == dropped and m.stats[e + STAT_FORWARDS] == 1
    assert m.stats[:e].sum() == n * k  # loads count what the router chose, dropped or not
    m.eval()
    m(x)
    assert m.stats[e + STAT_FORWARDS] == 1  # evaluation records nothing


def _hf_experts_into(ours, gate_up, down):
    i = gate_up.shape[1] // 2
    with torch.no_grad():
        ours.w1.copy_(gate_up[:, :i].transpose(1, 2))
        ours.w3.copy_(gate_up[:, i:].transpose(1, 2))
        ours.w2.copy_(down.transpose(1, 2))


def _hf_mlp_into(ours, mlp):
    with torch.no_grad():
        ours.w1.weight.copy_(mlp.gate_proj.weight)
        ours.w3.weight.copy_(mlp.up_proj.weight)
        ours.w2.weight.copy_(mlp.down_proj.weight)


def _randomise(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


def test_blocks_match_transformers_mixtral_qwen_and_deepseek():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    x = torch.randn(2, 7, H)
    common = dict(hidden_size=H, num_experts_per_tok=3, hidden_act="silu")
    cases = [
        (MixtralSparseMoeBlock(MixtralConfig(num_local_experts=8, intermediate_size=F, **common)),
         MoEConfig(num_experts=8, top_k=3)),
        (Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=8, moe_intermediate_size=F,
                                               norm_topk_prob=False, **common)),
         MoEConfig(num_experts=8, top_k=3, norm_topk_prob=False)),
        (Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(num_experts=8, moe_intermediate_size=F,
                                               shared_expert_intermediate_size=2 * F,
                                               norm_topk_prob=True, **common)),
         MoEConfig(num_experts=8, top_k=3, num_shared_experts=1,
                   shared_expert_ffn_hidden_size=2 * F, shared_expert_gate=True)),
        (DeepseekV3MoE(DeepseekV3Config(n_routed_experts=8, moe_intermediate_size=F, n_group=4,
                                        topk_group=2, n_shared_experts=2, norm_topk_prob=True,
                                        routed_scaling_factor=2.5, **common)),
         MoEConfig(num_experts=8, top_k=3, router="sigmoid", n_group=4, topk_group=2,
                   num_shared_experts=2, routed_scaling_factor=2.5)),
    ]
    for hf, cfg in cases:
        _randomise(hf)
        ours = MoE(H, F, cfg)
        ours.init_buffers()
        with torch.no_grad():
            ours.router.gate.weight.copy_(hf.gate.weight)
        if hasattr(hf.gate, "e_score_correction_bias"):
            hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # non-zero bias
            ours.set_expert_bias(hf.gate.e_score_correction_bias)
        _hf_experts_into(ours.experts, hf.experts.gate_up_proj, hf.experts.down_proj)
        shared = getattr(hf, "shared_experts", None) or getattr(hf, "shared_expert", None)
        if shared is not None:
            _hf_mlp_into(ours.shared_experts, shared)
        if hasattr(hf, "shared_expert_gate"):
            with torch.no_grad():
                ours.shared_experts_gate.weight.copy_(hf.shared_expert_gate.weight)
        hf.eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(x), hf(x.clone()), rtol=1e-5, atol=1e-5,
                                       msg=type(hf).__name__)


def test_router_runs_in_fp32_under_bf16_autocast():
    r = Router(H, MoEConfig(num_experts=8, top_k=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = r(torch.randn(6, H))
    assert route.logits.dtype == route.weights.dtype == route.probs.dtype == torch.float32


def test_balance_losses_against_their_definitions_and_transformers():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = MoEConfig(num_experts=8, top_k=2, aux_loss_coeff=1.0, seq_aux_loss_coeff=1.0,
                    z_loss_coeff=1.0)
    r = Router(H, cfg)
    b, t = 3, 10
    route = r(torch.randn(b * t, H))
    loads = torch.bincount(route.experts.reshape(-1), minlength=8).float()
    raw = balance_losses(route, loads, b, t, cfg)
    # transformers sums f over the k choices: k times the Switch/Megatron normalisation
    hf = load_balancing_loss_func((route.logits,), 8, 2)
    torch.testing.assert_close(raw["aux_loss"] * 2, hf)
    seq = []
    for s in range(b):
        ex = route.experts.view(b, t, 2)[s]
        f = torch.bincount(ex.reshape(-1), minlength=8).float() * 8 / (2 * t)
        seq.append((f * route.probs.view(b, t, 8)[s].mean(0)).sum())
    torch.testing.assert_close(raw["seq_aux_loss"], torch.stack(seq).mean())
    torch.testing.assert_close(raw["z_loss"], (route.logits.logsumexp(-1) ** 2).mean())
    # perfectly balanced routing and uniform probabilities give exactly 1
    uniform = type(route)(route.weights, torch.arange(b * t * 2).view(-1, 2) % 8,
                          torch.full((b * t, 8), 1 / 8), route.logits)
    even = balance_losses(uniform, torch.full((8,), b * t * 2 / 8), b, t, cfg)
    torch.testing.assert_close(even["aux_loss"], torch.tensor(1.0))


def _routed_losses(router: Router, x: torch.Tensor, cfg: MoEConfig, reduce=None) -> dict:
    b, t, _ = x.shape
    route = router(x.reshape(-1, H))
    loads = torch.bincount(route.experts.reshape(-1), minlength=cfg.num_experts).float()
    return balance_losses(route, loads, b, t, cfg, reduce)


def test_balance_losses_summed_over_sequence_halves_equal_the_whole_batch():
    """Context parallelism in one process: each half of every sequence is a
    "rank" whose reduce adds the other half's statistics (kept with their
    graph, as the all-reduce's backward sums gradients). Each half's losses
    equal the whole batch's, and the halves weighted by their token shares
    give the whole batch's gradients."""
    cfg = MoEConfig(num_experts=8, top_k=2, router="sigmoid", norm_topk_prob=True,
                    aux_loss_coeff=1.0, seq_aux_loss_coeff=1.0, z_loss_coeff=1.0)
    torch.manual_seed(0)
    router = Router(H, cfg)
    x = torch.randn(3, 12, H, requires_grad=True)
    # balanced chunks as cp=2 cuts them: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    halves = [torch.cat([x[:, :3], x[:, 9:]], 1), x[:, 3:9]]
    whole = _routed_losses(router, x, cfg)
    grads_whole = torch.autograd.grad(sum(whole.values()), [x, router.gate.weight])

    sent = []
    for half in halves:  # what each rank hands its reduce
        _routed_losses(router, half, cfg, lambda v: sent.append(v) or v)
    parts = [_routed_losses(router, half, cfg, lambda v, r=r: v + sent[1 - r])
             for r, half in enumerate(halves)]
    assert set(parts[0]) == set(whole) == {"aux_loss", "seq_aux_loss", "z_loss"}
    for part in parts:
        for name, value in whole.items():
            torch.testing.assert_close(part[name], value, rtol=1e-6, atol=0)
    # each "rank" weights its (identical) losses by its share of the tokens
    total = sum(0.5 * sum(part.values()) for part in parts)
    grads = torch.autograd.grad(total, [x, router.gate.weight])
    for got, want in zip(grads, grads_whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # and without the reduce a half's losses are not the whole batch's
    alone = _routed_losses(router, halves[0], cfg)
    assert not torch.allclose(alone["seq_aux_loss"], whole["seq_aux_loss"])


def test_balance_losses_without_any_on_never_call_reduce():
    cfg = MoEConfig(num_experts=8, top_k=2)
    calls = []
    out = _routed_losses(Router(H, cfg), torch.randn(2, 4, H), cfg, lambda v: calls.append(v) or v)
    assert out == {} and not calls


def test_aux_loss_is_stored_weighted_and_taken_once():
    m = _moe(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    m.train()
    m(torch.randn(2, 6, H))
    aux = m.take_aux_loss()
    raw_aux, raw_z = m.stats[8 + 1], m.stats[8 + 3]
    torch.testing.assert_close(aux.detach(), 0.01 * raw_aux + 0.001 * raw_z)
    assert aux.requires_grad and m.take_aux_loss() is None


def test_bias_update_moves_towards_balance_and_keeps_mean_zero():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.1)
    # over-loaded expert 0 goes down, under-loaded expert 1 up, the mean stays 0
    assert bias[0] < 0 < bias[1] and abs(float(bias.sum())) < 1e-6


def test_config_checks_fail_in_one_line():
    base = ["model.moe={}"]
    for override, key, words in (
            (["model.moe.top_k=9"], "model.moe.top_k", "above num_experts"),
            (["model.moe.n_group=3"], "model.moe.n_group", "does not divide"),
            (["model.moe.first_k_dense=4"], "model.moe", "no MoE layer"),
            (["model.moe.dense_layers=[7]"], "model.moe.dense_layers[0]", "not in 0..3"),
            (["model.arch=gpt", "model.num_kv_heads=null"], "model.moe", "need arch llama")):
        with pytest.raises(ConfigError) as e:
            load_config(None, base + override)
        assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value)


def _model_cfg(**moe) -> ModelConfig:
    return ModelConfig(hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=64, vocab_size=64, max_seq_len=16,
                       moe=MoEConfig(**{"num_experts": 4, "top_k": 2, **moe}))


def test_dense_and_moe_layers_mix_and_parameters_are_counted():
    for moe, sparse in (({"first_k_dense": 1}, [1, 2, 3, 4, 5]),             # DeepSeek-V3
                        ({"dense_layers": [2], "sparse_step": 2}, [1, 3, 5]),  # Qwen3-MoE
                        ({"num_shared_experts": 2, "shared_expert_gate": True,
                          "expert_ffn_hidden_size": 16}, list(range(6)))):
        cfg = _model_cfg(**moe)
        cfg.validate()
        model = build_model(cfg, device="cpu")
        got = [int(name) for name, b in model.layers.items() if isinstance(b.feed_forward, MoE)]
        assert got == sparse == cfg.moe.sparse_layers(6)
        assert count_params(model) == cfg.num_params()


def test_meta_init_zeroes_the_bias_and_dcp_saves_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    from giantmodel.checkpoint.state import ModelState

    cfg = _model_cfg(router="sigmoid", bias_update_rate=0.01)
    model = init_weights(build_model(cfg), cfg, seed=1)
    layers = moe_layers(model)
    assert len(layers) == 6 and all(float(m.router.expert_bias.abs().sum()) == 0 for m in layers)
    w2 = layers[0].experts.w2
    assert abs(float(w2.detach().std()) - cfg.init_std / math.sqrt(12)) < 0.3 * cfg.init_std / math.sqrt(12)
    layers[0].router.expert_bias.copy_(torch.arange(4.0))
    state = {"model": ModelState(model)}
    assert "layers.0.feed_forward.router.expert_bias" in state["model"].state_dict()
    dcp.save(state, checkpoint_id=str(tmp_path))
    fresh = build_model(cfg)
    fresh.to_empty(device="cpu")
    dcp.load({"model": ModelState(fresh)}, checkpoint_id=str(tmp_path))
    for module in fresh.modules():  # what every loader does after loading weights
        if hasattr(module, "init_buffers"):
            module.init_buffers(device="cpu")
    assert torch.equal(moe_layers(fresh)[0].router.expert_bias, torch.arange(4.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_experts_take_the_fused_grouped_gemm_and_match_the_loop():
    """On a Hopper-class GPU, auto picks torch._grouped_mm's fused kernel for
    bf16 (elsewhere the loop); either way, with dropped tokens, outputs and
    gradients match the per-expert loop, and every gradient is finite."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=0.7, num_shared_experts=1)
    m = MoE(64, 96, cfg).cuda()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    m.init_buffers("cuda")
    cap = torch.cuda.get_device_capability()
    assert compat.grouped_mm_fused(torch.device("cuda"), torch.bfloat16) == (
        compat.has("grouped_mm") and cap[0] in (9, 10))
    x = torch.randn(4, 37, 64, device="cuda")
    results = []
    for impl in ("auto", "loop"):
        m.experts.impl = impl
        m.zero_grad()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(xg)
        out.float().square().mean().backward()
        results.append([out.float(), xg.grad] + [p.grad.float() for p in m.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < 2e-2  # bf16 rounding, not a wrong row


def _autograd_loop(x, counts, w1, w3, w2):
    """The expert loop as plain autograd ops (what _ExpertLoop does by hand)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        if e < w1.shape[0]:
            outs.append((nn.functional.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
        else:
            outs.append(torch.zeros_like(xe[:, :w2.shape[2]]))  # dropped rows
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_written_expert_loop_and_gathers_equal_autograd(dtype):
    """The CPU loop's autograd function against the same ops under autograd:
    an expert with no rows, dropped trailing rows, under bf16 autocast too;
    a second backward (zero-bubble's split input/weight pass) gives the
    same gradients. gather_rows and the k-way combine against indexing and
    bmm, with gradients."""
    from giantmodel.models.common.moe import GroupedExperts, _Combine, gather_rows

    torch.manual_seed(0)
    experts = GroupedExperts(H, F, 4, impl="loop")
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    counts = [5, 0, 7, 3, 2]                                   # 2 dropped rows at the end
    x = torch.randn(sum(counts), H)
    up = torch.randn(sum(counts), H)
    results = []
    for fn in (lambda xx: experts(xx, torch.tensor(counts)),
               lambda xx: _autograd_loop(xx, counts, experts.w1, experts.w3, experts.w2)):
        experts.zero_grad()
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y = fn(xx)
        (y[:15].float() * up[:15]).sum().backward(retain_graph=True)
        grads = [xx.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
        (y[:15].float() * up[:15]).sum().backward()   # accumulates the same again
        again = [xx.grad] + [p.grad for p in experts.parameters()]
        for g, g2 in zip(grads, again):
            torch.testing.assert_close(g2, 2 * g)
        results.append((y[:15].float(), grads))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, **tol)
    assert results[0][1][1][1].abs().sum() == 0  # expert 1 took no rows: zero gradient

    k, rows = 3, torch.randn(4, H, requires_grad=True)
    order = torch.randperm(4 * k)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(4 * k))
    got = gather_rows(rows, order // k, inverse, k)
    want = rows.detach().requires_grad_(True)
    assert torch.equal(got, want[order // k])
    g = torch.randn(4 * k, H)
    (got * g).sum().backward()
    (want[order // k] * g).sum().backward()
    torch.testing.assert_close(rows.grad, want.grad)

    # two copies (top-2) take their own sum: bit-equal to the reduction, in bf16 too
    for dt in (torch.float32, torch.bfloat16):
        rows2 = torch.randn(5, H, dtype=dt, requires_grad=True)
        order2 = torch.randperm(10)
        inverse2 = torch.empty_like(order2).scatter_(0, order2, torch.arange(10))
        g2 = torch.randn(10, H, dtype=dt)
        gather_rows(rows2, order2 // 2, inverse2, 2).backward(g2)
        assert torch.equal(rows2.grad, g2[inverse2].view(5, 2, H).sum(dim=1))

    y, w = torch.randn(6, k, H, requires_grad=True), torch.rand(6, k, requires_grad=True)
    y2, w2 = y.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out, ref = _Combine.apply(y, w), torch.bmm(w2.unsqueeze(1), y2).squeeze(1)
    torch.testing.assert_close(out, ref)
    g = torch.randn(6, H)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(y.grad, y2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_selective_recompute_keeps_the_expert_loops_gate_and_up_products():
    """Under selective recompute the CPU loop's ``x w1`` and ``x w3`` are
    plain matmul outputs the policy keeps: backward re-runs only the w2
    products (out= variants), not the 2 E gate/up GEMMs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from giantmodel.parallel.recompute import _selective_context

    experts = _experts(3, "loop")
    counts = torch.tensor([4, 5, 3])
    x = torch.randn(12, H, requires_grad=True)
    y = checkpoint(lambda t: experts(t, counts), x, use_reentrant=False,
                   context_fn=_selective_context)

    class CountMM(TorchDispatchMode):
        calls: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.calls[name] = self.calls.get(name, 0) + (func in (torch.ops.aten.mm.default,
                                                                    torch.ops.aten.mm.out))
            return func(*args, **(kwargs or {}))

    mode = CountMM()
    with mode:
        y.sum().backward()
    # per expert: the re-run w2 product, then d h, d w2, d x (its mm; the
    # w3 half is an addmm_), d w1, d w3: 6; 8 if x w1 and x w3 re-ran too
    assert mode.calls.get("aten.mm", 0) == 3 * 6, mode.calls


@pytest.mark.skipif(not GROUPED_ON_CPU, reason="torch._grouped_mm has no CPU kernel here")
def test_selective_recompute_keeps_the_grouped_gemms_outputs():
    """The grouped path's three ``_grouped_mm`` outputs are matmul outputs
    the selective policy keeps (the planner's selective terms count them):
    its backward runs as many grouped GEMMs as without any recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from giantmodel.parallel.recompute import _selective_context

    class CountGrouped(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func.overloadpacket is torch.ops.aten._grouped_mm
            return func(*args, **(kwargs or {}))

    experts = _experts(3, "grouped_mm")
    counts = torch.tensor([4, 5, 3])
    x = torch.randn(12, H, requires_grad=True)
    seen = {}
    for name, run in (("plain", lambda: experts(x, counts)),
                      ("selective", lambda: checkpoint(lambda t: experts(t, counts), x,
                                                       use_reentrant=False,
                                                       context_fn=_selective_context))):
        y = run()
        mode = CountGrouped()
        with mode:
            y.sum().backward()
        seen[name] = mode.calls
    assert seen["plain"] > 0 and seen["selective"] == seen["plain"], seen
