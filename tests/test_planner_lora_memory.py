"""The planner's LoRA memory against LoRA models the objective really builds
(single process, tiny models): the frozen base's bytes (bf16 under bf16
training, NF4 base linears with QLoRA), and what a block keeps for backward
with a frozen base: bf16 (no copies of it) or fp32 under fp16 (cast once per
step where a fused group reads it, per call by autocast where an adapted
linear does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_planner_activations import B, T, autocast, tiny

from giantmodel.config.schema import JobConfig
from giantmodel.core.loss import cross_entropy_sum
from giantmodel.objectives.lora import LoRA
from giantmodel.parallel.objective import StageSpec
from giantmodel.planner.layout import Cluster, resolve_layout
from giantmodel.planner.measure import LiveStorageCounter
from giantmodel.planner.memory import (
    lora_frozen_bytes,
    lora_layer_shapes,
    memory_report,
    param_table,
)


def _job(arch: str, precision: str, targets: list[str], nf4: bool = False,
         layers: int = 3, **model_kw) -> JobConfig:
    # vocab 4096: the default tokenizer's size, which the LM objective checks
    m = dataclasses.replace(tiny(arch, vocab_size=4096, **model_kw), num_layers=layers)
    cfg = JobConfig(model=m, objective="lora", precision=precision)
    cfg.lora.rank, cfg.lora.targets = 8, targets
    cfg.lora.quantize_base = "nf4" if nf4 else "none"
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.global_batch_size = T, B, B
    return cfg


def _built(cfg: JobConfig) -> torch.nn.Module:
    """The model as training gets it: built, frozen, initialised (the base
    cast or quantised by the objective)."""
    torch.manual_seed(0)
    obj = LoRA.from_config(cfg)
    model = obj.build(StageSpec())
    obj.init_weights(model, torch.device("cpu"))
    return model


def _nbytes(p: torch.Tensor) -> int:
    if hasattr(p, "get_original_weight"):  # an NF4 tensor: its inner tensors
        return sum(_nbytes(getattr(p, n)) for n in p.__tensor_flatten__()[0])
    return p.numel() * p.element_size()


CASES = [("llama", "bf16", ["all_linear"], {}), ("gpt", "bf16", ["q_proj", "w1"], {}),
         ("llama", "fp32", ["all_linear"], {}),
         # wk/wv hold 96 x 256 values, not a multiple of NF4's 64 x 256 blocks:
         # QLoRA keeps them in bf16
         ("llama", "bf16", ["all_linear"], {"nf4": True, "num_heads": 6, "num_kv_heads": 3})]


@pytest.mark.parametrize("arch, precision, targets, kw", CASES)
def test_frozen_base_bytes_match_the_built_model(arch, precision, targets, kw):
    if kw.get("nf4"):
        pytest.importorskip("torchao")
    cfg = _job(arch, precision, targets, **kw)
    model = _built(cfg)
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in frozen.values() if not hasattr(p, "get_original_weight")}
    assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}, dtypes
    n_nf4 = sum(hasattr(p, "get_original_weight") for p in frozen.values())
    assert n_nf4 == (cfg.model.num_layers * 5 if kw.get("nf4") else 0)   # wq wo w1 w2 w3
    assert {p.dtype for p in adapters} == {torch.float32}
    layout = resolve_layout(cfg, Cluster(1, 1))
    table = param_table(cfg.model)
    want = lora_frozen_bytes(table, layout, tuple(layout.rank_stages(0)))
    got = sum(_nbytes(p) for p in frozen.values())
    assert want == got, (want, got)
    n_adapters = cfg.model.num_layers * sum(a * b for a, b in lora_layer_shapes(table, layout))
    assert n_adapters == sum(p.numel() for p in adapters)
    params = memory_report(cfg.model, layout, None).ranks[0].components["params"]
    assert params == got + 4 * n_adapters


def _autocast(precision: str):
    if precision == "fp16":
        return torch.autocast("cpu", dtype=torch.float16)
    return autocast(precision)


def _forward_bytes(cfg: JobConfig) -> int:
    model = _built(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    live = LiveStorageCounter()
    with live, _autocast(cfg.precision):
        loss, _ = cross_entropy_sum(model(ids), ids)
    nbytes = live.live_bytes()
    loss.backward()
    return nbytes


BLOCK_CASES = [("llama", "bf16", ["all_linear"]), ("llama", "bf16", ["q_proj", "v_proj"]),
               ("llama", "bf16", ["w2"]), ("gpt", "bf16", ["q_proj", "w1"]),
               ("llama", "fp16", ["q_proj", "v_proj"])]


@pytest.mark.parametrize("arch, precision, targets", BLOCK_CASES)
def test_block_under_a_frozen_base_keeps_what_the_planner_says(arch, precision, targets):
    """Per block, without recompute (measured as the difference between 3
    and 1 layers): the norms' compute-dtype outputs read without casts; a
    fused group with no adapter (q|k|v, gate|up, w2 alone) keeping its
    input though its weights are frozen, a GPT MLP linear without one
    keeping none; the adapters' ``A x`` and their autocast weight copies.
    Under bf16 the base is bf16 (no copies of it); under fp16 it stays
    fp32: the fused groups keep their casts for the step, the adapted
    linears' bases are cast by autocast at each call and kept to backward."""
    per = {}
    for layers in (3, 1):
        cfg = _job(arch, precision, targets, layers=layers)
        c = memory_report(cfg.model, resolve_layout(cfg, Cluster(1, 1)), None).ranks[0].components
        per[layers] = (_forward_bytes(cfg), c["activations"] + c["working_weights"])
    measured = (per[3][0] - per[1][0]) / 2
    predicted = (per[3][1] - per[1][1]) / 2
    assert abs(predicted / measured - 1) < 0.02, (measured, predicted)


# ------------------------------------------------- tensor + sequence parallel
def _tp_block_saved(tp: int, targets: list[str]) -> int:
    """Bytes block 1 of a LoRA model saves for backward on this rank (bf16
    autocast, tp + sp with the objective's own plan; parameters and the
    block's input excluded)."""
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.parallel.parallelize import parallelize
    from giantmodel.parallel.strategy import NoDataParallel
    from giantmodel.planner.measure import SavedTensorCounter

    dims = ParallelDims(world_size=tp, dp_replicate=1, tp=tp)
    dims.build_mesh("cpu")
    cfg = _job("llama", "bf16", targets, layers=2)
    obj = LoRA.from_config(cfg)
    model = obj.build(StageSpec())
    parallelize(model, obj, dims, NoDataParallel(dims), sp=tp > 1, recompute="none",
                offload=cfg.offload, compile=False)
    obj.init_weights(model, torch.device("cpu"))
    params = tuple(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    seen = {}

    def enter(_module, args):
        x = args[0]
        local = x.to_local() if hasattr(x, "to_local") else x
        seen["saved"] = SavedTensorCounter(exclude=params + (local,)).__enter__()

    block = model.layers["1"]
    block.register_forward_pre_hook(enter)
    block.register_forward_hook(lambda *_: seen["saved"].__exit__(None, None, None))
    ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with obj.loss_context(), autocast("bf16"):
        model(ids)
    return seen["saved"].bytes


def _tp_worker(rank, world):
    return {tuple(t): _tp_block_saved(world, t) for t in (["all_linear"], ["q_proj", "v_proj"])}


def test_block_under_tp_and_sp_keeps_what_the_planner_says():
    """tp2 + sp, no recompute: an adapted group takes its input replicated
    (the adapters keep it whole), a group without adapters keeps its
    sequence shard; the frozen base stays fp32 (DTensors), so each adapted
    linear's base is cast by autocast and kept to backward, while the
    fused groups' casts are kept on the modules (not saved: not counted
    here)."""
    from giantmodel.planner.frozen import base_copy_numel
    from giantmodel.planner.memory import layer_activation_bytes
    from giantmodel.testing import run_ranks

    results = run_ranks(_tp_worker, 2, timeout=240)
    for targets in (["all_linear"], ["q_proj", "v_proj"]):
        cfg = _job("llama", "bf16", targets, layers=1)
        cfg.parallel.tp, cfg.parallel.sp = 2, True
        layout = resolve_layout(cfg, Cluster(1, 2))
        table = param_table(cfg.model)
        acts = layer_activation_bytes(cfg.model, "bf16", "none", B, T, tp=2, sp=True,
                                      lora=(layout.lora_rank, layout.lora_paths))
        per_use, _ = base_copy_numel(cfg.model, table.layer, layout, sharded=False)
        adapters = sum(a * b for a, b in lora_layer_shapes(table, layout))
        pred = sum(acts.values()) - acts["attention_norm.input"] + 2 * (per_use + adapters)
        pred += T * cfg.model.dim_per_head * 4   # the RoPE rows (the planner's edges)
        measured = max(r[tuple(targets)] for r in results)
        assert abs(pred / measured - 1) < 0.02, (targets, measured, pred)
