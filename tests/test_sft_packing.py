"""Packing: several examples per row give the same per-example loss and the
same gradients as one example per row (fp32, within 1e-6), because attention
is block-diagonal causal and positions restart at every example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from giantmodel.config import load_config
from giantmodel.core.loss import IGNORE_INDEX
from giantmodel.data.loader import rows_to_batch
from giantmodel.data.sft import SFTStats, build_rows, fit_examples
from giantmodel.models import build_model, init_weights
from giantmodel.models.common import masks

TOL = 1e-6
V = 96


def _model(arch: str):
    kv = "model.num_kv_heads=2" if arch == "llama" else "model.num_kv_heads=null"
    cfg = load_config(overrides=[f"model.arch={arch}", "model.hidden_size=32", "model.num_layers=2",
                                 "model.num_heads=4", kv, "model.ffn_hidden_size=64",
                                 f"model.vocab_size={V}", "model.max_seq_len=64",
                                 "train.seq_len=48"])
    return init_weights(build_model(cfg.model), cfg.model, seed=3)


def _examples(n: int = 9):
    """Token ids with a prompt part (no loss) and a response part."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        length = int(rng.integers(5, 20))
        ids = rng.integers(1, V, length).astype(np.int32)
        mask = np.zeros(length, dtype=bool)
        mask[int(rng.integers(1, length - 1)):] = True
        out.append((ids, mask))
    return out


def _per_example(model, batch, packed: bool):
    """Per-example loss sums (in example order) and the token-mean loss."""
    kw = {}
    if packed:
        kw = {"positions": batch["position_ids"], "document_ids": batch["document_ids"]}
    logits = model(batch["input_ids"], **kw)
    labels = batch["labels"]
    tok = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view(labels.shape)
    docs = batch["document_ids"] if packed else torch.zeros_like(labels)
    sums = []
    for r in range(labels.shape[0]):
        for d in docs[r].unique(sorted=True).tolist():
            if d < 0:
                continue
            sel = (docs[r] == d) & (labels[r] != IGNORE_INDEX)
            if sel.any():
                sums.append(tok[r][sel].sum())
    total = torch.stack(sums)
    return total, total.sum() / (labels != IGNORE_INDEX).sum()


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_packed_equals_unpacked_loss_and_gradients(arch):
    torch.manual_seed(0)
    model = _model(arch)
    seq = 40
    examples = fit_examples(_examples(), seq, True, SFTStats())
    results = {}
    for packed in (False, True):
        stats = SFTStats()
        rows = build_rows(examples, seq, packed, 0, stats)
        batch = rows_to_batch(rows, packed)
        model.zero_grad()
        per_ex, mean = _per_example(model, batch, packed)
        mean.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[packed] = (per_ex.detach(), mean.item(), grads, stats.rows)
    (a, ma, ga, rows_a), (b, mb, gb, rows_b) = results[False], results[True]
    assert rows_b < rows_a  # it really packed
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < TOL * max(1.0, a.abs().max().item())
    assert abs(ma - mb) < TOL
    for n in ga:
        assert (ga[n] - gb[n]).abs().max().item() < TOL, n


def test_positions_restart_and_attention_stays_inside_each_example():
    model = _model("llama")
    examples = fit_examples(_examples(4), 40, True, SFTStats())
    rows = build_rows(examples, 40, True, 0, SFTStats())
    batch = rows_to_batch(rows, True)
    docs, pos = batch["document_ids"][0], batch["position_ids"][0]
    for d in docs.unique().tolist():
        assert pos[docs == d].tolist() == list(range(int((docs == d).sum())))
    # Changing the second example's tokens leaves the first and third untouched.
    ids = batch["input_ids"].clone()
    out = model(ids, batch["position_ids"], batch["document_ids"])
    ids[0][docs == 1] = (ids[0][docs == 1] + 7) % V
    out2 = model(ids, batch["position_ids"], batch["document_ids"])
    same = (docs != 1)
    assert torch.equal(out[0][same], out2[0][same])
    assert not torch.allclose(out[0][docs == 1], out2[0][docs == 1])


def test_flex_block_mask_and_varlen_segments_match_dense(monkeypatch):
    """The GPU kernels' mask forms, checked on CPU: flex attention (eager, as
    compiling it takes a minute here) gives the dense mask's output, and the
    varlen boundaries cut the flattened batch at each example and row."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(masks, "_compiled_flex", flex_attention)
    torch.manual_seed(0)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4, [0] * 16])
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    dense = masks.masked_attention(q, k, v, masks.document_mask(docs, torch.float32, "dense"))
    flex = masks.masked_attention(q, k, v, masks.document_mask(docs, torch.float32, "flex"))
    assert (dense - flex).abs().max().item() < 1e-5
    seg = masks.varlen_segments(docs)
    assert seg.cu_seqlens.tolist() == [0, 5, 12, 16, 32] and seg.max_len == 16
    assert masks.document_mask(docs, torch.bfloat16).__class__ is masks.DenseMask  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, kind", [(torch.bfloat16, masks.VarlenMask),
                                         (torch.float32, masks.FlexMask)])
def test_gpu_packed_kernels_match_dense(dtype, kind):
    torch.manual_seed(0)
    docs = torch.tensor([[0] * 40 + [1] * 60 + [2] * 28, [0] * 128], device="cuda")
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype)
    v = torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype)
    fast = masks.document_mask(docs, dtype)
    assert isinstance(fast, kind)
    ref = masks.masked_attention(q.float(), k.float(), v.float(),
                                 masks.document_mask(docs, torch.float32, "dense"))
    out = masks.masked_attention(q, k, v, fast).float()
    assert (out - ref).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
