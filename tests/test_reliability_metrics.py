"""MFU inputs (issue defect 9): the FLOP formula and the peak table."""

from __future__ import annotations

import logging

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.metrics import flops
from giantmodel.models import build_model


@pytest.mark.parametrize("arch,tie", [("llama", False), ("gpt", True)])
def test_flops_per_token_is_palms_formula_over_the_built_model(arch, tie):
    cfg = ModelConfig(arch=arch, hidden_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2 if arch == "llama" else None, ffn_hidden_size=160,
                      vocab_size=300, max_seq_len=128, tie_embeddings=tie)
    model = build_model(cfg, device="meta")
    embeddings = {"tok_embeddings.weight", "pos_embeddings.weight", "output.weight"}
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if n not in embeddings)
    T = 96
    head = cfg.vocab_size * cfg.hidden_size  # the output matmul counts, tied or not
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * T
    assert flops.flops_per_token(cfg, T) == 6 * (non_embedding + head) + attention


@pytest.mark.parametrize("name,precision,tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),   # SXM
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "fp16", 835.0),
    ("NVIDIA H200", "bf16", 989.0),
    ("NVIDIA H200 NVL", "bf16", 835.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla V100-PCIE-16GB", "fp16", 112.0),
    ("Tesla V100-SXM2-32GB", "bf16", None),     # no bf16 tensor cores
    ("NVIDIA GeForce RTX 4090", "bf16", None),  # not on record
])
def test_gpu_peak_table(name, precision, tflops):
    assert flops.gpu_peak_tflops(name, precision) == tflops


def test_unknown_gpu_warns_once_and_reports_no_mfu(monkeypatch, caplog):
    monkeypatch.delenv("GIANTMODEL_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    flops._warned.clear()
    with caplog.at_level(logging.WARNING, logger="giantmodel.metrics.flops"):
        assert flops.peak_flops(torch.device("cuda"), "bf16") == 0.0
        assert flops.peak_flops(torch.device("cuda"), "bf16") == 0.0
    warnings = [r for r in caplog.records if "Mystery GPU 9000" in r.getMessage()]
    assert len(warnings) == 1 and "GIANTMODEL_PEAK_TFLOPS" in warnings[0].getMessage()
    monkeypatch.setenv("GIANTMODEL_PEAK_TFLOPS", "100")
    assert flops.peak_flops(torch.device("cuda"), "bf16") == 100e12


def _fake_sysfs(root, siblings: dict[int, tuple[int, int]]):
    for cpu, (package, core) in siblings.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text(f"{package}\n")
    return str(root)


def test_cpu_peak_counts_physical_cores_in_the_affinity_mask(tmp_path, monkeypatch):
    # 8 logical CPUs: 4 cores with 2 SMT threads each (siblings cpu i and i+4)
    sysfs = _fake_sysfs(tmp_path, {i: (0, i % 4) for i in range(8)})
    monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert flops.usable_cores(sysfs) == 4
    monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: {0, 4, 1})  # taskset -c 0,1,4
    assert flops.usable_cores(sysfs) == 2
    monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: {2})
    assert flops.usable_cores(sysfs) == 1
