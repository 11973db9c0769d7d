"""Model construction, meta-device init, shapes and invariants (HF parity lives in test_hf*)."""

import pytest
import torch

from giantmodel.config.model import ModelConfig, RopeScaling
from giantmodel.models import build_model, count_params, init_weights
from giantmodel.models.common.layers import apply_rope, rope_inv_freq, rope_table


def tiny(arch="llama", **kw):
    base = dict(arch=arch, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=96, vocab_size=128, max_seq_len=32)
    if arch == "gpt":
        base["num_kv_heads"] = None
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("cfg", [tiny(), tiny(tie_embeddings=True), tiny(num_kv_heads=1),
                                 tiny(attn_bias=True), tiny("gpt"), tiny("gpt", tie_embeddings=True)],
                         ids=["llama-gqa", "llama-tied", "llama-mqa", "llama-bias", "gpt", "gpt-tied"])
def test_forward_shape_and_exact_param_count(cfg):
    model = init_weights(build_model(cfg), cfg, seed=0)
    assert not any(p.is_meta for p in model.parameters())
    logits = model(torch.randint(0, cfg.vocab_size, (2, 10)))
    assert logits.shape == (2, 10, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert count_params(model) == cfg.num_params()
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight


def test_meta_build_allocates_nothing():
    cfg = ModelConfig(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                      ffn_hidden_size=28672, vocab_size=128256)  # a 70B shape
    model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == cfg.num_params()


def test_init_is_deterministic_and_independent_of_which_layers_exist():
    cfg = tiny()
    full = init_weights(build_model(cfg), cfg, seed=3)
    again = init_weights(build_model(cfg), cfg, seed=3)
    other_seed = init_weights(build_model(cfg), cfg, seed=4)
    # A pipeline-stage-like chunk: only layer 2 and the head.
    stage = build_model(cfg)
    stage.tok_embeddings = None
    del stage.layers["0"], stage.layers["1"]
    init_weights(stage, cfg, seed=3)
    fs, ss = full.state_dict(), stage.state_dict()
    assert set(ss) < set(fs)
    for name, value in ss.items():
        assert torch.equal(value, fs[name]), name
    for name, value in again.state_dict().items():
        assert torch.equal(value, fs[name])
    assert not torch.equal(other_seed.layers["0"].attention.wq.weight, full.layers["0"].attention.wq.weight)


def test_output_projection_init_is_scaled_by_depth():
    cfg = tiny(num_layers=8, hidden_size=256, ffn_hidden_size=512)
    m = init_weights(build_model(cfg), cfg, seed=0)
    std_q = m.layers["0"].attention.wq.weight.std().item()
    std_o = m.layers["0"].attention.wo.weight.std().item()
    assert std_q == pytest.approx(cfg.init_std, rel=0.05)
    assert std_o == pytest.approx(cfg.init_std / 4.0, rel=0.05)


def test_causality_future_tokens_do_not_change_past_logits():
    for arch in ("llama", "gpt"):
        cfg = tiny(arch)
        m = init_weights(build_model(cfg), cfg, seed=0).eval()
        x = torch.randint(0, cfg.vocab_size, (1, 12))
        y = x.clone()
        y[0, 8:] = (y[0, 8:] + 1) % cfg.vocab_size
        torch.testing.assert_close(m(x)[:, :8], m(y)[:, :8])


def test_positions_argument_matches_a_shifted_window():
    """A chunk given its absolute positions equals the same rows of the full
    sequence's computation at layer input — the property context parallelism uses."""
    cfg = tiny(num_layers=1)
    m = init_weights(build_model(cfg), cfg, seed=0).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    table = m.rope
    q = torch.randn(1, 16, 2, cfg.dim_per_head)
    full = apply_rope(q, table[:16])
    part = apply_rope(q[:, 8:], table[torch.arange(8, 16)])
    torch.testing.assert_close(full[:, 8:], part)
    assert m(x, positions=torch.arange(16)).shape == (1, 16, cfg.vocab_size)


def test_gqa_equals_mha_with_repeated_kv_heads():
    cfg = tiny(num_kv_heads=2)
    gqa = init_weights(build_model(cfg), cfg, seed=0).eval()
    mha_cfg = tiny(num_kv_heads=4)
    mha = init_weights(build_model(mha_cfg), mha_cfg, seed=0).eval()
    sd = gqa.state_dict()
    hd = cfg.dim_per_head
    for i in range(cfg.num_layers):
        for name in ("wk", "wv"):
            w = sd[f"layers.{i}.attention.{name}.weight"].view(2, hd, -1)
            sd[f"layers.{i}.attention.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


def test_llama3_rope_scaling_bands():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    base = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, s)
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    mid = ~(high | low)
    assert mid.any() and ((scaled[mid] <= base[mid]) & (scaled[mid] >= base[mid] / 8)).all()
    assert rope_table(128, 16, 500000.0, s).shape == (16, 128)
