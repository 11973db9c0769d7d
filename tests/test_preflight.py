"""train's memory preflight: the planner's peak per rank against the memory
the rank has, before the model is built (giantmodel.train.preflight,
giantmodel.planner.preflight)."""

from __future__ import annotations

import glob
import subprocess
import sys
import time

import pytest
import torch

import giantmodel.planner  # noqa: F401  (registers the estimator, as the CLI does)
from giantmodel.config import ConfigError, load_config
from giantmodel.core.memory_hook import memory_estimator
from giantmodel.planner import preflight as planner_preflight
from giantmodel.planner.preflight import memory_shortfall
from giantmodel.train import preflight

CPU = torch.device("cpu")


def _cfg(path=None, *overrides):
    return load_config(path, list(overrides), validate=False)


def test_7b_preset_fails_fast_in_one_line():
    """The issue's run: 7B in fp32 with AdamW on a host far smaller than its
    ~120 GB; it must stop before building anything, naming both figures."""
    avail = preflight.host_available_bytes()
    if avail is None or avail > 100e9:
        pytest.skip("needs a host with under 100 GB available")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "giantmodel", "train", "--config", "configs/llama/7b.yaml",
         "data.source=synthetic", "data.paths=[]", "data.tokenizer=null"],
        capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    line = lines[0]
    assert line.startswith("error: train.memory_check: llama-7b needs about 1"), line
    assert "GB per rank" in line and "MemAvailable" in line and "fits with" in line, line
    assert elapsed < 30, elapsed   # under 10 s on a quiet host (a shared CI core is slower)


def test_tiny_presets_are_not_refused():
    avail = preflight.host_available_bytes()
    assert avail is not None and avail > 0
    paths = [None, "configs/moe/tiny.yaml", *sorted(glob.glob("configs/finetune/tiny-*.yaml"))]
    for path in paths:
        cfg = _cfg(path)
        assert memory_shortfall(cfg, 1, "cpu", avail, "test") is None, path


def test_refusal_names_the_cheapest_fixes():
    cfg = _cfg(None, "model.num_layers=8", "train.micro_batch_size=8",
               "train.global_batch_size=64", "train.seq_len=512")
    peak = planner_preflight.rank_peak_bytes(cfg, 1, "cpu")
    fixes = planner_preflight.cheapest_fixes(cfg, 1, "cpu", 0.7 * peak)
    assert fixes and fixes[0].startswith("recompute="), fixes
    line = memory_shortfall(cfg, 1, "cpu", 0.7 * peak, "here")
    assert line and "\n" not in line and "fits with recompute=" in line
    # within the planner's error the run goes ahead
    assert memory_shortfall(cfg, 1, "cpu", 0.95 * peak, "here") is None
    # no recompute or zero stage on one rank fits a fifth: the fewest ranks that do
    more = planner_preflight.cheapest_fixes(cfg, 1, "cpu", 0.2 * peak)
    assert more and more[0].startswith("8 ranks with parallel.zero=3 recompute=full"), more


def test_unmodelled_configs_and_planner_failures_are_skipped(monkeypatch):
    for cfg in (_cfg("configs/moe/tiny.yaml"), _cfg("configs/sd/tiny.yaml")):
        assert memory_shortfall(cfg, 1, "cpu", 1.0, "here") is None

    def broken(*a, **k):
        raise RuntimeError("not modelled")
    monkeypatch.setattr(planner_preflight, "rank_peak_bytes", broken)
    assert memory_shortfall(_cfg(), 1, "cpu", 1.0, "here") is None


def test_check_memory_hook_switch_and_local_ranks(monkeypatch, tmp_path):
    assert memory_estimator() is memory_shortfall
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemAvailable:     8000 kB\n")
    read = preflight.host_available_bytes
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: read(str(meminfo)))
    avail, where = preflight.available_per_rank(CPU, 4)
    assert avail == 8000 * 1024 / 4 and "4 local ranks" in where
    cfg = _cfg()
    with pytest.raises(ConfigError, match="train.memory_check: .*needs about"):
        preflight.check_memory(cfg, CPU, 1, 1)
    cfg.train.memory_check = False
    preflight.check_memory(cfg, CPU, 1, 1)   # skipped

