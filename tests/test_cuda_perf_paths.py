"""The CUDA memory and speed paths, checked on the CPU: what selective
recompute keeps, how often a packed batch's mask is built, which masks
context-parallel attention hands to SDPA, and QLoRA's build."""

from __future__ import annotations

import importlib
import importlib.util
import math

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.models.common import masks
from giantmodel.models.registry import build_model, init_weights


def _model(cfg: ModelConfig, seed: int = 0):
    return init_weights(build_model(cfg), cfg, seed)


def _tiny(arch: str = "llama", layers: int = 3, **kw) -> ModelConfig:
    base = dict(arch=arch, vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4,
                num_kv_heads=2 if arch == "llama" else 4, ffn_hidden_size=64, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------ selective recompute
class _Ctx:
    def __init__(self, is_recompute: bool):
        self.is_recompute = is_recompute


def test_selective_policy_saves_packed_attention_kernels():
    """The flex-attention op and varlen's custom op are kept in forward and
    read back in the recompute, like SDPA's fused kernels; before, the policy
    did not know them and they ran again in backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    from giantmodel.parallel.recompute import _SelectivePolicy

    flex = pytest.importorskip("torch._higher_order_ops.flex_attention").flex_attention
    ops = [flex, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        importlib.import_module("torch.nn.attention.varlen")  # registers its custom op
        ops.append(torch.ops.torch_attn._varlen_attn.default)
    policy = _SelectivePolicy()
    for op in ops:
        for phase in (False, True):
            assert policy(_Ctx(phase), op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(_Ctx(False), torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_recompute_runs_packed_attention_once():
    """A packed batch under selective recompute: the attention kernel runs
    once per block in forward and not again in backward (an outer dispatch
    mode sees only the kernels that really execute), and gradients match
    the model without recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from giantmodel.parallel.recompute import _ATTENTION, apply_recompute

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in _ATTENTION
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = _tiny(layers=2)
    ref, model = _model(cfg), _model(cfg)
    apply_recompute(model, {f"layers.{i}": "selective" for i in range(2)})
    ids = torch.randint(0, 64, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16) * torch.tensor([[1], [0]])
    pos = pos + torch.tensor([[0], [1]]) * torch.arange(16)
    counter = Count()
    with counter:
        model(ids, positions=pos, document_ids=docs).sum().backward()
    ref(ids, positions=pos, document_ids=docs).sum().backward()
    assert counter.n == 2  # one per block, forward only
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# ------------------------------------------------------------ packed-batch masks
def test_document_mask_is_built_once_per_batch(monkeypatch):
    """One mask per forward whatever the depth, and none at all when the
    same batch goes through again; a new or modified batch builds anew."""
    calls = []
    real = masks._build_document_mask
    monkeypatch.setattr(masks, "_build_document_mask",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(_tiny(layers=4)).eval()
    ids = torch.randint(0, 64, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    with torch.no_grad():
        first = model(ids, document_ids=docs)
        assert len(calls) == 1
        torch.testing.assert_close(model(ids, document_ids=docs), first)
        assert len(calls) == 1
        model(ids, document_ids=docs.clone())
        assert len(calls) == 2
        docs[1, 8:] = 1  # in place: the cached mask no longer describes it
        changed = model(ids, document_ids=docs)
        assert len(calls) == 3
    assert not torch.allclose(changed[1], first[1])


# ------------------------------------------------------------ context parallelism
def _cp_mask_worker(rank, world):
    """cp 2 with GQA, forward and backward, recording every attn_mask that
    reaches SDPA; returns them with this rank's output and gradients."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from giantmodel.parallel import context

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, dout = _cp_inputs()
    local = [context.shard_sequence(t.transpose(1, 2), world, rank).transpose(1, 2).clone()
             .requires_grad_() for t in (q, k, v)]
    out = context.ContextParallelSDPA(torch.nn.Identity(), mesh)(*local)
    out.backward(context.shard_sequence(dout.transpose(1, 2), world, rank).transpose(1, 2))
    dist.barrier()
    return [m if m is None else tuple(m.shape) for m in seen], out.detach(), local[0].grad


def _cp_inputs():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, h, 32, 8, generator=g) for h in (4, 2, 2, 4)]


@pytest.mark.timeout(120)
def test_cp2_gqa_passes_no_mask_tensor_to_sdpa():
    import torch.nn.functional as F

    from giantmodel.parallel.context import shard_sequence
    from giantmodel.testing import run_ranks

    results = run_ranks(_cp_mask_worker, 2, timeout=110)
    q, k, v, dout = (t.clone().requires_grad_() for t in _cp_inputs())
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    # The first chunk (rank 0's) is plain causal SDPA; every other chunk runs
    # the fused kernels directly. Before, each of those passed a bool mask.
    seen = [m for masks_seen, _, _ in results for m in masks_seen]
    assert seen and all(m is None for m in seen), seen
    for r, (_, out, dq) in enumerate(results):
        local = [shard_sequence(t.transpose(1, 2), 2, r).transpose(1, 2) for t in (ref, q.grad)]
        torch.testing.assert_close(out, local[0].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dq, local[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_causal_attention_matches_masked_sdpa(dtype):
    """One chunk's attention over the keys before it plus its own diagonal
    block, merged by log-sum-exp, against SDPA with the lower-right mask:
    outputs and q/k/v gradients, with GQA."""
    import torch.nn.functional as F

    from giantmodel.parallel.context import _SplitCausalAttention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 8, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 24, 16, generator=g).to(dtype).requires_grad_() for _ in "kv")
    dout = torch.randn(2, 4, 8, 16, generator=g).to(dtype)
    out = _SplitCausalAttention.apply(q, k, v, 16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = torch.ones(8, 24, dtype=torch.bool).tril(16)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("kind", ["flash", "efficient"])
def test_split_causal_attention_cuda_kernels_plumbing(monkeypatch, kind):
    """The CUDA kernels' calls, run on the meta device (their shape
    functions): arguments in schema order, outputs unpacked right, the
    efficient kernel's padded log-sum-exp handled, GQA gradients in K/V's
    own head count. Numbers need a GPU (tests marked gpu)."""
    from giantmodel.parallel import context

    monkeypatch.setattr(context, "_lse_kernel", lambda q: kind)
    dtype = torch.bfloat16 if kind == "flash" else torch.float32
    q = torch.empty(2, 8, 40, 64, device="meta", dtype=dtype, requires_grad=True)
    k, v = (torch.empty(2, 2, 120, 64, device="meta", dtype=dtype, requires_grad=True)
            for _ in "kv")
    out = context._SplitCausalAttention.apply(q, k, v, 80)
    assert out.shape == q.shape and out.dtype == dtype
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ------------------------------------------------------------ QLoRA
# Every block linear a multiple of 64 x 256 values, so NF4 holds them all.
QTINY = ["model.arch=llama", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=4", "model.ffn_hidden_size=256", "model.vocab_size=256",
         "model.max_seq_len=64"]


@pytest.fixture(scope="module")
def qbase(tmp_path_factory):
    from giantmodel.config import load_config
    from giantmodel.models.hf import to_hf

    root = tmp_path_factory.mktemp("qlora")
    cfg = load_config(overrides=QTINY + ["train.seq_len=16"])
    to_hf(_model(cfg.model, seed=7), cfg.model, root / "base")
    return root / "base"


def _qconfig(base, run_dir, *extra):
    from giantmodel.config import load_config

    return load_config(overrides=QTINY + [
        "objective=lora", "lora.rank=4", "lora.alpha=8.0", "lora.targets=[all_linear]",
        "data.source=synthetic", f"checkpoint.init_from={base}", f"run.dir={run_dir}",
        "train.steps=3", "train.seq_len=16", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.eval_every=0", "train.sample_tokens=0",
        "train.device=cpu", "checkpoint.every=0", "run.tensorboard=false",
        "run.progress=false", "optim.lr=0.01", "optim.warmup_steps=0",
        "optim.schedule=constant", *extra])


def _losses(cfg, steps: int = 3):
    from giantmodel.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        model = trainer.engine.parts[0]
        return [trainer.train_step()["loss"] for _ in range(steps)], model
    finally:
        trainer.close()


def test_qlora_stages_the_float_base_linears_off_the_device():
    """With a device stand-in (meta) the objective materialises the model
    on: every linear NF4 will hold is staged on the CPU (in bf16 under bf16
    training), so none lands on the device in float; everything else does."""
    pytest.importorskip("torchao")
    from giantmodel.models.lora import LoRALinear
    from giantmodel.objectives.lora import LoRA
    from giantmodel.parallel.objective import StageSpec

    obj = LoRA.from_config(_qconfig("/nowhere", "/nowhere", "lora.quantize_base=nf4",
                                    "precision=bf16"))
    module = obj.build(StageSpec())
    obj.init_weights(module, torch.device("meta"))
    staged = {n for n, m in module.named_modules() if isinstance(m, LoRALinear)}
    assert len(staged) == 2 * 7
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner in staged and name.endswith(".weight"):
            assert p.device.type == "cpu" and p.dtype == torch.bfloat16, name
        else:
            assert p.is_meta, name


def test_qlora_bf16_build_and_training(qbase, tmp_path):
    """After loading: base linears NF4 (dequantising to bf16), the other
    frozen parameters bf16, adapters fp32 and alone trainable; bf16 QLoRA
    trains with a loss near fp32 LoRA's from the same base."""
    pytest.importorskip("torchao")
    from giantmodel.models.lora import LoRALinear

    ref, _ = _losses(_qconfig(qbase, tmp_path / "lora", "precision=fp32"))
    losses, model = _losses(_qconfig(qbase, tmp_path / "q", "precision=bf16",
                                     "lora.quantize_base=nf4"))
    nf4 = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert nf4 and all(hasattr(m.weight, "get_original_weight") for m in nf4)
    assert all(m.base_weight().dtype == torch.bfloat16 for m in nf4)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.dtype == torch.float32, name
        elif not hasattr(p, "get_original_weight"):
            assert not p.requires_grad and p.dtype == torch.bfloat16, name
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, ref, strict=True)), (losses, ref)
    assert losses[-1] < losses[0]


def test_qlora_fp32_loss_matches_lora(qbase, tmp_path):
    """fp32 QLoRA: the base stays fp32 where NF4 cannot hold it, and the
    loss follows plain LoRA's within the 4-bit error."""
    pytest.importorskip("torchao")
    ref, _ = _losses(_qconfig(qbase, tmp_path / "lora", "precision=fp32"))
    losses, model = _losses(_qconfig(qbase, tmp_path / "q", "precision=fp32",
                                     "lora.quantize_base=nf4"))
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, ref, strict=True)), (losses, ref)


# ------------------------------------------------------------ on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_split_causal_attention_matches_masked_sdpa(dtype):
    """The flash (bf16) and efficient (fp32) kernels' parts, merged by
    log-sum-exp, against fp32 masked SDPA, with GQA: outputs and grads."""
    import torch.nn.functional as F

    from giantmodel.parallel.context import _lse_kernel, _SplitCausalAttention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device="cuda", generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 384, 64, device="cuda", generator=g).to(dtype).requires_grad_()
            for _ in "kv")
    dout = torch.randn_like(q)
    assert _lse_kernel(q) == ("flash" if dtype == torch.bfloat16 else "efficient")
    out = _SplitCausalAttention.apply(q, k, v, 256)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = torch.ones(128, 384, dtype=torch.bool, device="cuda").tril(256)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.gpu
@cuda
def test_cuda_selective_recompute_keeps_varlen_attention():
    from torch.utils._python_dispatch import TorchDispatchMode

    from giantmodel.parallel.recompute import _ATTENTION, apply_recompute

    if not masks._varlen_available():
        pytest.skip("this torch has no varlen_attn")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _ATTENTION:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    cfg = _tiny(layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, ffn_hidden_size=256)
    model = _model(cfg).to("cuda", torch.bfloat16)
    apply_recompute(model, {f"layers.{i}": "selective" for i in range(2)})
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    docs = torch.tensor([[0] * 12 + [1] * 20, [0] * 32], device="cuda")
    counter = Count()
    with counter:
        model(ids, document_ids=docs).float().sum().backward()
    assert len(counter.ops) == 2 and all("varlen" in op for op in counter.ops), counter.ops


@pytest.mark.gpu
@cuda
def test_cuda_generate_bf16_with_cache():
    from giantmodel.models.generate import generate, place_for_generation

    model = place_for_generation(_model(_tiny("llama", max_seq_len=64)))
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = generate(model, prompt, 16, temperature=0)
    assert out.shape == (1, 20) and out.device.type == "cuda"
    fp32 = place_for_generation(_model(_tiny("gpt", max_seq_len=64)), "cuda", "fp32")
    assert torch.equal(generate(fp32, prompt, 16, temperature=0),
                       generate(fp32, prompt, 16, temperature=0, use_cache=False))


@pytest.mark.gpu
@cuda
def test_cuda_qlora_peak_memory_stays_below_the_float_base(qbase, tmp_path):
    """On the GPU, building and loading the QLoRA model never holds the
    float block linears there: the peak stays well under the fp32 model."""
    pytest.importorskip("torchao")
    from giantmodel.config import load_config
    from giantmodel.models.registry import count_params
    from giantmodel.train.trainer import Trainer

    cfg = _qconfig(qbase, tmp_path / "q", "precision=bf16", "lora.quantize_base=nf4",
                   "train.device=cuda")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(cfg)
    try:
        peak = torch.cuda.max_memory_allocated() - before
        loss = trainer.train_step()["loss"]
    finally:
        trainer.close()
    fp32_bytes = 4 * count_params(_model(load_config(overrides=QTINY).model))
    assert peak < 0.6 * fp32_bytes, (peak, fp32_bytes)
    assert math.isfinite(loss)


def test_document_mask_of_an_inference_tensor_is_built_each_time():
    with torch.inference_mode():
        docs = torch.tensor([[0, 0, 1, 1]])
        first = masks.document_mask(docs, torch.float32)
        assert masks.document_mask(docs, torch.float32) is not first
    torch.testing.assert_close(first.mask, masks.dense_document_mask(docs))
