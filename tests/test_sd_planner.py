"""``giantmodel estimate`` and ``plan`` on Stable Diffusion configs: memory per
rank and images/s, from the shapes alone (meta device, nothing downloaded)."""

from __future__ import annotations

import json

from giantmodel.cli import main
from giantmodel.config import load_config


def _estimate(capsys, *extra):
    assert main(["estimate", "--config", "configs/sd/sd15.yaml", "--gpu", "a100-80g",
                 "--nodes", "1", "--gpus-per-node", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_sd15_estimate_memory_and_images_per_sec(capsys):
    z2 = _estimate(capsys)
    assert 0.8e9 < z2["model"]["unet_params"] < 0.9e9  # SD 1.5's UNet: 860M
    assert z2["memory"]["fits"]
    t = z2["time"]
    assert t["images_per_sec"] > 0 and 0 < t["mfu"] < 1
    # sharding the UNet's states over 8 ranks needs less memory per rank than replicating them
    z0 = _estimate(capsys, "parallel.zero=0")
    z3 = _estimate(capsys, "parallel.zero=3")
    mem = [d["memory"]["required_bytes_per_rank"] for d in (z0, z2, z3)]
    assert mem[0] > mem[1] > mem[2], mem


def test_sd_plan_writes_a_runnable_layout(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    assert main(["plan", "--config", "configs/sd/sd21-base.yaml", "--gpu", "a100-80g",
                 "--nodes", "1", "--gpus-per-node", "8", "--top", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "images/s" in text and "#1" in text
    cfg = load_config(out)
    assert cfg.objective == "diffusion" and cfg.parallel.dp == 8
    cfg.validate()
