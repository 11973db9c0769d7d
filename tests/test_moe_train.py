"""MoE in training: auxiliary-loss-free balancing from a skewed router, the
auxiliary losses' scale under gradient accumulation and data parallelism,
per-step MoE metrics, and the routing bias checkpointed with the run."""

import json
import math

import pytest
import torch

from giantmodel.config import load_config
from giantmodel.config.moe import MoEConfig
from giantmodel.core.precision import Precision
from giantmodel.distributed.parallel_dims import ParallelDims
from giantmodel.models.common.moe import Router, moe_layers, update_expert_bias
from giantmodel.objectives import build_objective
from giantmodel.testing import run_ranks
from giantmodel.train.trainer import Trainer, build_engine, run_training

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=64", "model.vocab_size=128", "model.max_seq_len=32",
         "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden_size=32",
         "model.moe.num_shared_experts=1", "model.moe.router=sigmoid",
         "model.moe.bias_update_rate=0.01", "model.moe.seq_aux_loss_coeff=0.01",
         "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
         "train.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=4",
         "data.source=synthetic", "train.log_every=1", "train.sample_tokens=0",
         "train.eval_every=0", "optim.warmup_steps=2", "run.tensorboard=false"]


def cfg_for(tmp_path, *extra):
    return load_config(None, [*SMALL, f"run.dir={tmp_path}", *extra])


def _load_ratio(router: Router, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    experts = router(tokens).experts
    loads = torch.bincount(experts.reshape(-1), minlength=router.cfg.num_experts).float()
    return float(loads.max() / loads.mean()), loads


def test_bias_updates_balance_a_skewed_router():
    """A router whose gate prefers two of eight experts: max/mean load starts
    above 2. Bias updates alone (no gradient step) bring it below 1.3; the
    same router without them stays skewed."""
    hidden, steps = 16, 300
    torch.manual_seed(0)
    direction = torch.randn(hidden)
    ratios = {}
    for rate in (0.0, 0.005):
        router = Router(hidden, MoEConfig(num_experts=8, top_k=2, router="sigmoid",
                                          bias_update_rate=rate or 1e-9))
        with torch.no_grad():
            router.gate.weight.normal_(0, 0.1)
            router.gate.weight[:2] += 0.1 * direction  # experts 0 and 1 see most tokens
        gen = torch.Generator().manual_seed(1)
        # measured on 4096 tokens: sampling noise alone is then ~1.05
        first, _ = _load_ratio(router, torch.randn(4096, hidden, generator=gen) + direction)
        for _ in range(steps):
            _, loads = _load_ratio(router, torch.randn(256, hidden, generator=gen) + direction)
            update_expert_bias(router.expert_bias, loads, rate)
        ratios[rate] = (first, _load_ratio(router, torch.randn(4096, hidden, generator=gen)
                                           + direction)[0])
    assert ratios[0.0][0] > 2 and ratios[0.005][0] > 2, ratios
    assert ratios[0.005][1] < 1.3, ratios
    assert ratios[0.0][1] > 2, ratios


def _engine_grads(tmp_path, micro: int, batch: dict, *extra):
    cfg = cfg_for(tmp_path, f"train.micro_batch_size={micro}", *extra)
    cfg.validate()
    dims = ParallelDims.from_config(cfg, 1)
    objective = build_objective(cfg)
    engine = build_engine(cfg, objective, dims, torch.device("cpu"))
    mbs = [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, 8, micro)]
    loss = engine.forward_backward(mbs, Precision("fp32", "cpu"))
    layers = moe_layers(engine.parts[0])
    _LAST_ENGINE[:] = layers
    return loss, layers[0].router.gate.weight.grad.clone()


_LAST_ENGINE: list = []  # the MoE layers of the last engine _engine_grads built


def test_aux_losses_keep_their_scale_under_gradient_accumulation(tmp_path):
    """The same 8 rows as one micro-batch of 8 or four of 2: with every micro-
    batch a copy of the same two sequences, each micro-batch's balance losses
    equal the whole batch's, so loss and router gradients must agree exactly
    when the auxiliary terms are token-weighted means (not sums over
    micro-batches). The logged loss is the LM loss alone."""
    torch.manual_seed(0)
    rows = torch.randint(0, 128, (2, 17))
    ids = rows.repeat(4, 1)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    one = _engine_grads(tmp_path / "a", 8, batch)
    four = _engine_grads(tmp_path / "b", 2, batch)
    off = _engine_grads(tmp_path / "c", 8, batch, "model.moe.aux_loss_coeff=0",
                        "model.moe.seq_aux_loss_coeff=0", "model.moe.z_loss_coeff=0")
    assert one[0] == pytest.approx(four[0], rel=1e-6) and one[0] == pytest.approx(off[0], rel=1e-6)
    torch.testing.assert_close(one[1], four[1], rtol=1e-5, atol=1e-8)
    assert not torch.allclose(one[1], off[1], rtol=1e-3, atol=0)  # the aux terms do act


def test_recompute_neither_changes_gradients_nor_counts_twice(tmp_path):
    """Recompute re-runs each block's forward inside backward: the auxiliary
    losses must still reach the router, once, and the step's loads count
    every token once (the bias update and metrics read them)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    plain = _engine_grads(tmp_path / "none", 4, batch)
    for mode in ("full", "selective"):
        loss, grad = _engine_grads(tmp_path / mode, 4, batch, f"recompute={mode}")
        assert loss == pytest.approx(plain[0], rel=1e-6)
        torch.testing.assert_close(grad, plain[1], rtol=1e-5, atol=1e-7)
        stats = _LAST_ENGINE[0].stats
        assert stats[:4].sum() == 8 * 16 * 2 and stats[4 + 4] == 2  # tokens x k, 2 forwards


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _biases(trainer) -> list[torch.Tensor]:
    return [m.router.expert_bias.clone() for m in moe_layers(trainer.engine.parts[0])]


@pytest.mark.timeout(120)
def test_metrics_bias_and_exact_resume(tmp_path):
    """Every step logs the MoE metrics; the bias moves; a run stopped after a
    step and resumed from its checkpoint (bias included) reproduces the
    uninterrupted run's losses and bias bit for bit."""
    extra = ["train.steps=6", "checkpoint.every=3"]
    straight = tmp_path / "straight"
    t = Trainer(cfg_for(straight, *extra))
    t.train()
    final = _biases(t)
    t.close()
    recs = [r for r in _records(straight) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        for key in ("moe_load_max_mean", "moe_dropped_tokens", "moe_aux_loss",
                    "moe_seq_aux_loss", "moe_z_loss"):
            assert key in r and math.isfinite(r[key]), (key, r)
        assert r["moe_load_max_mean"] >= 1 and r["moe_dropped_tokens"] == 0
        assert 0.5 < r["moe_aux_loss"] < 4

    interrupted = tmp_path / "interrupted"
    t = Trainer(cfg_for(interrupted, *extra))
    t.train_step()
    at_save = _biases(t)
    # one update moves every bias (later ones may pass through zero)
    assert all(float(b.abs().sum()) > 0 for b in at_save)
    t._save()
    t.close()
    t = Trainer(cfg_for(interrupted, *extra))  # resumes from run.dir
    assert t.state.step == 1
    for x, y in zip(_biases(t), at_save):
        assert torch.equal(x, y)
    t.train()
    resumed = _biases(t)
    t.close()
    b = [(r["step"], r["loss"]) for r in _records(interrupted) if "loss" in r]
    assert b == [(r["step"], r["loss"]) for r in recs[1:]]
    for x, y in zip(final, resumed):
        assert torch.equal(x, y)


def test_capacity_drops_are_logged(tmp_path):
    summary = run_training(cfg_for(tmp_path, "train.steps=2", "model.moe.capacity_factor=0.5",
                                   "checkpoint.save_final=false"))
    assert summary["step"] == 2
    assert all(r["moe_dropped_tokens"] > 0 for r in _records(tmp_path) if "loss" in r)


def _train_pp(rank, world, run_dir, *extra):
    run_training(cfg_for(run_dir, *extra))


@pytest.mark.timeout(180)
def test_pipeline_stages_add_aux_losses_and_log_every_layer(tmp_path):
    """pp2 with the auxiliary losses on: the dense first layer alone on
    stage 0 (rank 0, which logs), the MoE layer on stage 1. The losses and
    every MoE metric in metrics.jsonl equal one process's: the aux losses
    back-propagate within stage 1 and its metrics reach rank 0."""
    extra = ("train.steps=3", "checkpoint.save_final=false", "model.moe.first_k_dense=1")
    run_training(cfg_for(tmp_path / "one", *extra))
    run_ranks(_train_pp, 2, tmp_path / "pp", *extra, "parallel.pp=2")
    one = [r for r in _records(tmp_path / "one") if "loss" in r]
    two = [r for r in _records(tmp_path / "pp") if "loss" in r]
    keys = ["loss", "grad_norm", "moe_load_max_mean", "moe_dropped_tokens", "moe_aux_loss",
            "moe_seq_aux_loss", "moe_z_loss"]
    assert len(one) == len(two) == 3
    for a, b in zip(two, one):
        assert set(keys) <= set(a), a
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5)


def _dp_rank(rank, world, run_dir, zero=0):
    cfg = cfg_for(run_dir, "train.steps=3", "checkpoint.save_final=false", f"parallel.zero={zero}")
    t = Trainer(cfg)
    losses = [t.train_step()["loss"] for _ in range(3)]
    bias = [m.router.expert_bias.clone() for m in moe_layers(t.engine.parts[0])]
    t.close()
    return losses, bias


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_sums_loads_over_ranks_like_one_process(tmp_path, zero):
    """dp2 sees the global batch split over two ranks: with the loads summed
    over dp, each rank's bias after 3 steps is the single process's, and so
    are the losses (auxiliary losses on), with ZeRO-1's flat buffers and
    ZeRO-3's FSDP2 (stacked expert weights sharded on dim 0) alike."""
    one = _dp_rank(0, 1, tmp_path / "one")
    two = run_ranks(_dp_rank, 2, tmp_path / "two", zero)
    for losses, bias in two:
        assert losses == pytest.approx(one[0], rel=1e-5)
        for x, y in zip(bias, one[1]):
            torch.testing.assert_close(x, y)
