"""Model families under the engine's layouts, packing and LoRA export.

* Layouts: Qwen3 (qk-norm, head_dim != hidden / heads) at tp2 + sp, pp2,
  cp2 and ZeRO-3 at dp2, Qwen2's q/k/v biases at tp2, and Mistral's sliding
  window (6 < train.seq_len 16) at cp2, tp2 and packed under ZeRO-1, and
  Gemma 2's soft-capped attention and logits at tp2 each train 5 steps
  exactly like one process (tests/layout_harness.py), in one 2-rank spawn.
* Packing: with a sliding window, the per-example loss of a packed row is
  the loss of each example alone.
* LoRA: for each family, a LoRA run exported with ``convert --to peft`` and
  loaded by transformers + peft agrees with ``--merge-lora`` and with
  giantmodel within 1e-5.
"""

from __future__ import annotations

import argparse

import layout_harness as H
import pytest
import torch
from hf_helpers import lora_run_dir

from giantmodel.testing import run_ranks

# Gemma 2 on the tiny Gemma 3 (layout_harness.TINY): no qk-norm, one RoPE
# base, attention and final-logit soft-caps that bind on a tiny model (the
# capped math kernel on every layer, the capped vocab-parallel head: the
# losses move by up to 4e-4 without them). A final cap of 0.05 squeezes the
# logits so far that the grad norm's fp32 noise between layouts reaches 2e-5.
GEMMA2 = ["model.family=gemma2", "model.qk_norm=false", "model.rope_local_theta=null",
          "model.attn_softcap=0.05", "model.final_softcap=1.0"]

CASES = [
    ("qwen3", ["parallel.tp=2", "parallel.sp=true"]),
    ("qwen3", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    ("qwen3", ["parallel.cp=2"]),
    ("qwen3", ["parallel.dp=2", "parallel.zero=3"]),
    ("qwen2", ["parallel.tp=2"]),
    ("mistral", ["parallel.cp=2"]),
    ("mistral", ["parallel.tp=2"]),
    ("mistral", ["parallel.dp=2", "parallel.zero=1", "data.source=sft", "data.pack=true"]),
    ("gemma3", GEMMA2 + ["parallel.tp=2"]),
]


@pytest.mark.timeout(400)
def test_family_layouts_match_single_process():
    results = run_ranks(H.run_cases, 2, CASES, timeout=300)[0]
    failures = []
    for (arch, overrides), result in zip(CASES, results, strict=True):
        if "model.tie_embeddings=true" in H.TINY[arch] and any("pp=" in o for o in overrides):
            result["params"].pop("output.weight")
        try:
            H.assert_matches(result, H.reference(arch, overrides), f"{arch} {overrides}")
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_cp_window_skips_chunks_outside_it():
    """The window restricts which gathered key chunks a cp rank reads: with
    a window shorter than a chunk, a late chunk's attention reads only its
    own chunk and the one before (checked through the keys it is given)."""
    from giantmodel.parallel import context

    seen = []
    real = context.sliding_attention

    def spy(q, k, v, window, dropout_p=0.0):
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, window, dropout_p)

    class Mesh:  # one cp rank of two, without a process group
        def get_group(self):
            return None

        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    core = context.ContextParallelSDPA(torch.nn.Module(), Mesh())
    core.window = 3
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))  # chunks of 4 tokens, 16 in all
    gathered = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)
    real_gather, context.all_gather_kv = context.all_gather_kv, (lambda k, v, group: gathered)
    context.sliding_attention = spy
    try:
        core(q, k, v)
    finally:
        context.all_gather_kv, context.sliding_attention = real_gather, real
    # rank 0 holds chunks 0 (positions 0-3: keys 0-3) and 3 (positions
    # 12-15: keys 10-15 only, 6 of the 16 gathered)
    assert seen == [(4, 4), (4, 6)]


def test_packed_equals_unpacked_with_a_sliding_window():
    from giantmodel.config.model import ModelConfig
    from giantmodel.data.loader import document_positions
    from giantmodel.models import build_model, init_weights

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96, vocab_size=128, max_seq_len=64, sliding_window=5,
                      family="mistral")
    model = init_weights(build_model(cfg), cfg, seed=4).eval()
    g = torch.Generator().manual_seed(5)
    lengths = [11, 3, 9, 7]  # two longer than the window
    examples = [torch.randint(0, 128, (n,), generator=g) for n in lengths]
    row = torch.cat(examples)[None]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]

    def per_token_loss(logits, tokens):
        return torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="none")

    with torch.no_grad():
        packed = model(row, positions=document_positions(docs), document_ids=docs)
        start = 0
        for ex in examples:
            alone = model(ex[None])
            n = ex.shape[0]
            mine = packed[:, start:start + n]
            torch.testing.assert_close(per_token_loss(mine, ex[None]),
                                       per_token_loss(alone, ex[None]), rtol=1e-5, atol=1e-5)
            start += n
    # and the window matters here: without it the long examples' losses change
    full = ModelConfig(**{**cfg.__dict__, "sliding_window": None})
    model_full = init_weights(build_model(full), full, seed=4).eval()
    with torch.no_grad():
        assert (model_full(examples[0][None]) - model(examples[0][None])).abs().max() > 1e-4


# ------------------------------------------------------------------- LoRA -> PEFT
@pytest.mark.timeout(180)
def test_lora_peft_export_matches_merged_for_each_family(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from test_families_dense import make_hf

    from giantmodel.checkpoint import load_model_from_checkpoint
    from giantmodel.checkpoint.convert import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    for family, kw in (("qwen2", {"tie_word_embeddings": True}), ("qwen3", {"head_dim": 24}),
                       ("mistral", {"sliding_window": 8})):
        base, run = tmp_path / f"{family}-base", tmp_path / f"{family}-run"
        make_hf(family, **kw).save_pretrained(base)
        lora_run_dir(run, base, ["all_linear"])
        assert main(parser.parse_args([str(run), str(tmp_path / f"{family}-peft"),
                                       "--to", "peft"])) == 0
        assert main(parser.parse_args([str(run), str(tmp_path / f"{family}-merged"),
                                       "--to", "hf", "--merge-lora"])) == 0
        with torch.no_grad():
            ours = load_model_from_checkpoint(run)(tokens)
            merged = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / f"{family}-merged").eval()(tokens).logits
            base_model = transformers.AutoModelForCausalLM.from_pretrained(base)
            plain = base_model(tokens).logits
            with_adapter = peft.PeftModel.from_pretrained(
                base_model, tmp_path / f"{family}-peft").eval()(tokens).logits
        assert (ours - plain).abs().max().item() > 1e-3, family  # the adapters matter
        assert (ours - merged).abs().max().item() < 1e-5, family
        assert (with_adapter - merged).abs().max().item() < 1e-5, family
