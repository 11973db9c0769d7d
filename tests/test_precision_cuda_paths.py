"""Precision paths that matter most on CUDA, checked on the CPU: the fp16
unscale (one fused check, one host sync), TF32 for fp32 matmuls, and the
memory fields of the metrics rows."""

import json

import pytest
import torch

from giantmodel.config import load_config
from giantmodel.core.precision import Precision, configure_tf32, unscale_grads_


def _params(*grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def test_unscale_divides_every_dtype_and_finds_inf_and_nan():
    grads = [torch.full((5,), 8.0), torch.full((3,), 8.0, dtype=torch.float16), torch.zeros(0)]
    assert unscale_grads_(grads, 0.25) is False
    assert torch.equal(grads[0], torch.full((5,), 2.0))
    assert grads[1].dtype == torch.float16 and torch.equal(grads[1], torch.full((3,), 2.0,
                                                                                 dtype=torch.float16))
    for bad in (float("inf"), float("-inf"), float("nan")):
        grads = [torch.ones(4), torch.tensor([1.0, bad], dtype=torch.float16), torch.ones(2)]
        assert unscale_grads_(grads, 0.5) is True
    assert unscale_grads_([], 0.5) is False


def test_fp16_scaler_skips_on_overflow_and_unscales_otherwise():
    prec = Precision("fp16", "cpu", init_scale=256.0, growth_interval=2)
    params = _params(torch.full((3,), 512.0), torch.tensor([1.0, float("nan")]))
    seen = []
    assert prec.unscale_and_check(params, lambda f: seen.append(f) or f) is True
    assert seen == [True] and prec.scale == 128.0
    params = _params(torch.full((3,), 256.0), torch.full((2,), 128.0, dtype=torch.float16))
    assert prec.unscale_and_check(params) is False
    assert torch.equal(params[0].grad, torch.full((3,), 2.0))
    assert torch.equal(params[1].grad, torch.full((2,), 1.0, dtype=torch.float16))
    # another rank's overflow skips this rank's step too
    assert prec.unscale_and_check(_params(torch.ones(2)), lambda f: True) is True
    # bf16 / fp32 never scale
    p = _params(torch.full((2,), 3.0))
    assert Precision("bf16", "cpu").unscale_and_check(p) is False and float(p[0].grad[0]) == 3.0


@pytest.fixture
def restore_tf32():
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_tf32_is_set_on_cuda_only(restore_tf32):
    torch.set_float32_matmul_precision("highest")
    assert configure_tf32("cpu", True) is False
    assert torch.get_float32_matmul_precision() == "highest"
    assert configure_tf32("cuda", True) is True
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    configure_tf32("cuda", False)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.ffn_hidden_size=64", "model.vocab_size=128", "model.max_seq_len=16",
         "train.seq_len=16", "train.global_batch_size=2", "train.micro_batch_size=2",
         "data.source=synthetic", "train.log_every=1", "train.sample_tokens=0",
         "train.eval_every=0", "checkpoint.every=0", "checkpoint.save_final=false",
         "run.tensorboard=false", "train.steps=2"]


@pytest.mark.timeout(120)
def test_trainer_applies_tf32_for_its_device_and_logs_memory(tmp_path, monkeypatch):
    import giantmodel.train.trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "configure_tf32", lambda *a: calls.append(a) or False)
    # As a CUDA run would: the trainer hands its device type and train.tf32 over.
    cfg = load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.tf32=false"])
    trainer_mod.run_training(cfg)
    assert calls == [("cpu", False)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        # a CPU run logs the process's peak resident memory; CUDA runs log
        # max_memory_allocated / reserved under mem_* keys instead
        assert 10 < r["mem_peak_rss_gb"] * 1024 < 1024 * 1024
