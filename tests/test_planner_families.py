"""The planner on the model features of the newer families (q/k/v biases,
qk-norm, head_dim apart from hidden / heads, sliding windows), the LM loss
as train.loss_impl runs it, and ``giantmodel estimate`` on a pipeline split
with blockless stages."""

from __future__ import annotations

import json

from giantmodel.cli import main

# Llama 3 405B as the paper splits it (README, parallel.pp_layers): 126 blocks on
# pp 16 x virtual 8 = 128 stages, the first holding only the embedding and the
# last only the head and the loss.
LLAMA3_405B_SPLIT = [
    "--config", "configs/llama/llama3-8b.yaml", "--gpu", "h100-sxm", "--nodes", "16",
    "model.num_layers=126", "model.hidden_size=16384", "model.num_heads=128",
    "model.ffn_hidden_size=53248", "parallel.tp=8", "parallel.sp=true", "parallel.pp=16",
    "parallel.pp_virtual=8", "parallel.pp_schedule=interleaved_1f1b", "parallel.dp=1",
    "parallel.zero=1", "train.global_batch_size=16",
    "parallel.pp_layers=" + json.dumps([0] + [1] * 126 + [0]).replace(" ", ""),
]


def test_estimate_pipeline_split_with_blockless_stages(capsys):
    assert main(["estimate", *LLAMA3_405B_SPLIT]) == 0
    text = capsys.readouterr().out
    assert "stage 127 (rank 15):   0 layers" in text
    assert "126 layers cannot give each of 128 stages a block" in text
    assert main(["estimate", *LLAMA3_405B_SPLIT, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    stages = d["pipeline"]["stages"]
    assert len(stages) == 128 and stages[0]["layers"] == stages[-1]["layers"] == 0
    assert d["pipeline"]["suggested_pp_layers"] is None
    # the embedding-only and head-only chunks still cost time
    assert 0 < stages[0]["time_s"] < stages[1]["time_s"]
    assert d["layout"]["stage_layers"] == [0] + [1] * 126 + [0]
