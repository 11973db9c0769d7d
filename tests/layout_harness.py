"""Run a few optimizer steps under any layout and compare with one process.

Used by the layout-matrix tests (and the pipeline ones) from inside
``giantmodel.testing.run_ranks``:

    results = run_ranks(run_cases, 4, [("llama", ["parallel.tp=2"]), ...], 5)
    ref = reference("llama", ["parallel.tp=2"], 5)       # in the parent
    assert_matches(results[0][0], ref)

Every case uses a tiny model in fp32 with deterministic synthetic batches:
step ``s`` draws a global batch of G sequences; dp rank r feeds the
contiguous slice [r*G/dp, (r+1)*G/dp). Some labels are -100 so that ranks
hold different token counts and the global token mean is really exercised.

A case with ``data.pack=true`` feeds packed fine-tuning batches (several
examples per row: ``document_ids`` and restarting ``position_ids``); one
with ``objective=lora`` trains the LoRA objective; one with
``checkpoint.init_from`` starts from those weights, as the trainer does.
"""

from __future__ import annotations

import torch

STEPS = 5
LOSS_RTOL = 1e-5
PARAM_TOL = 1e-5

TINY = {
    "llama": ["model.arch=llama", "model.hidden_size=64", "model.num_layers=4",
              "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=128",
              "model.vocab_size=256", "model.max_seq_len=64"],
    "gpt": ["model.arch=gpt", "model.hidden_size=64", "model.num_layers=4",
            "model.num_heads=4", "model.num_kv_heads=null", "model.ffn_hidden_size=256",
            "model.vocab_size=256", "model.max_seq_len=64"],
    # Qwen3: qk-norm and a head_dim that is not hidden / heads
    "qwen3": ["model.arch=llama", "model.family=qwen3", "model.hidden_size=64",
              "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
              "model.head_dim=24", "model.qk_norm=true", "model.ffn_hidden_size=128",
              "model.vocab_size=256", "model.max_seq_len=64"],
    # Qwen2: biases on q, k and v only, tied embeddings
    "qwen2": ["model.arch=llama", "model.family=qwen2", "model.hidden_size=64",
              "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
              "model.qkv_bias=true", "model.tie_embeddings=true", "model.ffn_hidden_size=128",
              "model.vocab_size=256", "model.max_seq_len=64"],
    # Mistral: a sliding window shorter than train.seq_len (16)
    "mistral": ["model.arch=llama", "model.family=mistral", "model.hidden_size=64",
                "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
                "model.sliding_window=6", "model.ffn_hidden_size=128", "model.vocab_size=256",
                "model.max_seq_len=64"],
    # Gemma 3: local layers 0-2 and a global layer 3 (a pp2 stage holds 2-3:
    # one of each), local/global RoPE bases, its own softmax scale, qk-norm,
    # four norms per block, GeGLU, scaled and tied embeddings
    "gemma3": ["model.arch=llama", "model.family=gemma3_text", "model.hidden_size=64",
               "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
               "model.head_dim=16", "model.qk_norm=true", "model.sliding_window=6",
               "model.layer_types=[sliding_attention,sliding_attention,sliding_attention,"
               "full_attention]", "model.rope_theta=100000", "model.rope_local_theta=100",
               "model.attn_scale=0.2", "model.post_norms=true", "model.mlp_activation=gelu_tanh",
               "model.embed_scale=true", "model.tie_embeddings=true",
               "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64"],
    # MoE as configs/moe/tiny.yaml, scaled down: a dense first layer, 8
    # sigmoid-routed experts (top-2, renormalised) and a shared expert,
    # bias updates and all three balance losses on, dropless
    "moe": ["model.arch=llama", "model.hidden_size=64", "model.num_layers=4",
            "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=128",
            "model.vocab_size=256", "model.max_seq_len=64", "model.moe.num_experts=8",
            "model.moe.top_k=2", "model.moe.router=sigmoid", "model.moe.norm_topk_prob=true",
            "model.moe.expert_ffn_hidden_size=32", "model.moe.num_shared_experts=1",
            "model.moe.first_k_dense=1", "model.moe.bias_update_rate=0.01",
            "model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.01",
            "model.moe.z_loss_coeff=0.001"],
}
TRAIN = ["train.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.steps=5", "optim.lr=0.001", "optim.eps=1e-6", "optim.warmup_steps=0",
         "optim.schedule=constant", "optim.grad_clip=1.0", "precision=fp32"]


def make_config(arch: str, overrides: list[str]):
    from giantmodel.config import load_config

    return load_config(overrides=TINY[arch] + TRAIN + list(overrides))


def global_batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: input_ids and next-token labels, [G, T] each."""
    G, T, V = cfg.train.global_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(10_007 * (step + 1))
    seq = torch.randint(0, V, (G, T + 1), generator=gen)
    labels = seq[:, 1:].clone()
    labels[0, : T // 2] = -100  # uneven token counts across dp ranks
    labels[-1, -3:] = -100
    return seq[:, :-1].contiguous(), labels


def packed_documents(cfg, step: int) -> torch.Tensor:
    """Document ids [G, T] of a packed global batch: 1-4 examples per row,
    boundaries drawn per step."""
    G, T = cfg.train.global_batch_size, cfg.train.seq_len
    gen = torch.Generator().manual_seed(7_919 * (step + 1))
    docs = torch.zeros(G, T, dtype=torch.long)
    for row in range(G):
        cuts = torch.randint(1, T, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen)
        for c in cuts.tolist():
            docs[row, c:] += 1
    return docs


def local_microbatches(cfg, step: int, data_rank: int, data_world: int) -> list[dict]:
    from giantmodel.data.loader import document_positions

    ids, labels = global_batch(cfg, step)
    batch = {"input_ids": ids, "labels": labels}
    if cfg.data.pack:
        batch["document_ids"] = packed_documents(cfg, step)
        batch["position_ids"] = document_positions(batch["document_ids"])
    per = ids.shape[0] // data_world
    mbs = cfg.train.micro_batch_size
    mine = {k: v[data_rank * per:(data_rank + 1) * per] for k, v in batch.items()}
    return [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, per, mbs)]


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter at full shape under its canonical name, on every rank
    (collective: all ranks must call it)."""
    import torch.distributed as dist

    from giantmodel.models import canonical_name

    out: dict[str, torch.Tensor] = {}
    for part in engine.parts:
        for name, p in part.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[canonical_name(name)] = t.detach().float().cpu().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        for d in gathered:
            out.update(d)
    return out


def build_engine(cfg, dims, device="cpu"):
    """The language-model engine for ``cfg`` on ``dims`` (mesh already built)."""
    from giantmodel.objectives import LanguageModel, LoRA
    from giantmodel.train.trainer import build_engine as engine_for

    if cfg.objective == "lora":
        objective = LoRA(cfg.model, data=cfg.data, train=cfg.train, lora=cfg.lora,
                         init_from=cfg.checkpoint.init_from)
    else:
        objective = LanguageModel(cfg.model, data=cfg.data, train=cfg.train)
    engine = engine_for(cfg, objective, dims, torch.device(device))
    if cfg.checkpoint.init_from:
        objective.load_pretrained(engine.parts, cfg.checkpoint.init_from)
    return engine


def run_steps(cfg, steps: int = STEPS, device: str = "cpu", record_init: bool = False) -> dict:
    """Train ``steps`` steps under ``cfg`` in this process group (or alone);
    with ``record_init`` the result also holds the parameters before step 0."""
    import torch.distributed as dist

    from giantmodel.core.precision import Precision
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.train.moe_stats import MoEStepStats

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh(device)
    engine = build_engine(cfg, dims, device)
    # What init_from gave (so a test can tell the weights were really read).
    start = full_parameters(engine) if cfg.checkpoint.init_from else None
    precision = Precision(cfg.precision, device)
    opt = engine.build_optimizer(cfg.optim)
    # MoE routing biases move after each step, from loads summed over dp x cp
    # (free for a dense model)
    moe = MoEStepStats(engine.parts, dims.group_or_none("dp_cp"))
    init = full_parameters(engine) if record_init else None
    losses, norms = [], []
    for step in range(steps):
        mbs = local_microbatches(cfg, step, engine.data_rank, engine.data_world)
        losses.append(engine.forward_backward(mbs, precision))
        skip = precision.unscale_and_check(engine.parameters(), engine.any_rank)
        norms.append(engine.clip_grad_norm_(cfg.optim.grad_clip))
        if not skip:
            engine.optimizer_step(opt)
        moe.finish_step(update=not skip)
        engine.zero_grad(opt)
    params = full_parameters(engine)
    if world > 1:
        dims.destroy_mesh()
    out = {"losses": losses, "norms": norms, "params": params, "start": start}
    if init is not None:
        out["init"] = init
    return out


def run_cases(rank: int, world: int, cases: list, steps: int = STEPS) -> list:
    """``run_ranks`` target: each case is ``(arch, overrides)``; rank 0 returns
    the results, other ranks return None for each."""
    out = []
    for arch, overrides in cases:
        result = run_steps(make_config(arch, overrides), steps)
        # numpy, not torch: tensors cross process boundaries as shared-memory
        # handles that die with the rank that made them.
        for key in ("params", "start"):
            if result[key] is not None:
                result[key] = {k: v.numpy() for k, v in result[key].items()}
        out.append(result if rank == 0 else None)
    return out


_references: dict = {}


def reference(arch: str, overrides: list[str], steps: int = STEPS) -> dict:
    """The single-process run of the same case (parallel.* overrides dropped),
    with its initial parameters under ``"init"``. Computed once per test
    session and shared by every module that asks (callers only read it)."""
    kept = [o for o in overrides if not o.startswith("parallel.")]
    key = (arch, tuple(kept), steps)
    if key not in _references:
        _references[key] = run_steps(make_config(arch, kept), steps, record_init=True)
    return _references[key]


def assert_matches(result: dict, ref: dict, label: str = "",
                   loss_rtol: float = LOSS_RTOL, param_tol: float = PARAM_TOL,
                   norm_rtol: float | None = None) -> None:
    """Every step's loss and global grad norm within ``loss_rtol`` (relative; the norm
    within ``norm_rtol`` when given), and every final parameter within ``param_tol``
    (absolute + relative) of the reference."""
    norm_rtol = loss_rtol if norm_rtol is None else norm_rtol
    for step, (a, b) in enumerate(zip(result["losses"], ref["losses"], strict=True)):
        if abs(a - b) > loss_rtol * abs(b):
            raise AssertionError(f"{label}: step {step} loss {a!r} vs reference {b!r} "
                                 f"(rel {abs(a - b) / abs(b):.2e} > {loss_rtol})")
    for step, (a, b) in enumerate(zip(result["norms"], ref["norms"], strict=True)):
        if abs(a - b) > norm_rtol * abs(b):
            raise AssertionError(f"{label}: step {step} grad norm {a!r} vs reference {b!r}")
    assert set(result["params"]) == set(ref["params"]), (
        f"{label}: parameter names differ: {set(result['params']) ^ set(ref['params'])}")
    for name, ref_t in ref["params"].items():
        t = torch.as_tensor(result["params"][name])
        assert t.shape == ref_t.shape, f"{label}: {name} shape {tuple(t.shape)} vs {tuple(ref_t.shape)}"
        err = (t - ref_t).abs() - param_tol * ref_t.abs()
        if float(err.max()) > param_tol:
            raise AssertionError(f"{label}: {name} differs by {float((t - ref_t).abs().max()):.3e} "
                                 f"after {len(ref['losses'])} steps")


# Mixed precision: the layout and the single-process run round differently,
# and AdamW turns a rounding difference in a tiny gradient into a full-size
# step of either sign, so single parameters can differ by as much as they
# moved. What must agree is each tensor's update as a whole: the distance
# between the two runs' parameters must stay under UPDATE_RTOL of how far
# the reference moved them. A run that applied no update misses by 1.0, ten
# times the tolerance.
UPDATE_RTOL = 0.1
# The key bias gets a zero gradient in exact arithmetic (adding a constant to
# every key of a query leaves its softmax unchanged), so its "update" is
# rounding noise scaled up by AdamW: only the all-parameter check covers it.
NOISE_ONLY = ("attention.wk.bias",)


def assert_update_matches(result: dict, ref: dict, label: str = "", loss_rtol: float = 5e-4,
                          norm_rtol: float = 1e-2, update_rtol: float = UPDATE_RTOL) -> float:
    """Losses within ``loss_rtol``, grad norms within ``norm_rtol`` (relative),
    and every tensor within ``update_rtol`` of the reference's update; returns
    the worst tensor's ratio. ``ref`` must come from :func:`reference`."""
    for step, (a, b) in enumerate(zip(result["losses"], ref["losses"], strict=True)):
        if abs(a - b) > loss_rtol * abs(b):
            raise AssertionError(f"{label}: step {step} loss {a!r} vs reference {b!r} "
                                 f"(rel {abs(a - b) / abs(b):.2e} > {loss_rtol})")
    for step, (a, b) in enumerate(zip(result["norms"], ref["norms"], strict=True)):
        if abs(a - b) > norm_rtol * abs(b):
            raise AssertionError(f"{label}: step {step} grad norm {a!r} vs reference {b!r}")
    assert set(result["params"]) == set(ref["params"]), (
        f"{label}: parameter names differ: {set(result['params']) ^ set(ref['params'])}")
    worst, off_total, moved_total = 0.0, 0.0, 0.0
    for name, ref_t in ref["params"].items():
        moved = float((ref_t - ref["init"][name]).norm())
        off = float((torch.as_tensor(result["params"][name]) - ref_t).norm())
        off_total, moved_total = off_total + off ** 2, moved_total + moved ** 2
        if name.endswith(NOISE_ONLY):
            continue
        assert moved > 0, f"{label}: the reference never updated {name}"
        if off > update_rtol * moved:
            raise AssertionError(f"{label}: {name} is {off / moved:.3f} of its update away from "
                                 f"the reference after {len(ref['losses'])} steps (> {update_rtol})")
        worst = max(worst, off / moved)
    overall = (off_total / moved_total) ** 0.5
    if overall > update_rtol:
        raise AssertionError(f"{label}: the parameters are {overall:.3f} of their update away "
                             f"from the reference (> {update_rtol})")
    return worst
