"""``dpo.precompute_ref``: one reference pass at setup (once the loaders and
the reference's weights exist, before any loss) gives the same losses as the
reference forward every step, no reference forward runs during training,
the table in run.dir is reused by a resumed run, and dp, ZeRO-3, tp and pp
build the same table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from giantmodel.objectives.dpo_ref import TABLE_FILE, RefTable
from tests.test_dpo import STEPS, pairs_file, run_dpo  # noqa: F401  (pairs_file: a fixture)


@pytest.mark.parametrize("extra", [["dpo.use_lora=true"], ["data.pack=true"]],
                         ids=["lora", "full-packed"])
def test_precomputed_reference_matches_and_is_reused(pairs_file, tmp_path, extra):  # noqa: F811
    data = [f"data.paths=[{pairs_file}]", f"run.dir={tmp_path / 'run'}"] + extra
    live = run_dpo(data)
    assert live["objective"].ref_forwards == STEPS * 2  # two micro-batches a step
    first = run_dpo(data + ["dpo.precompute_ref=true"])
    obj = first["objective"]
    np.testing.assert_allclose(first["losses"], live["losses"], rtol=0, atol=1e-6)
    for a, b in zip(first["metrics"], live["metrics"], strict=True):
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    # every pair row scored once, in micro-batches of 2 pair rows, then none
    pair_rows = len(obj.ref_table.keys)
    assert obj.ref_forwards == -(-pair_rows // 2)
    path = tmp_path / "run" / TABLE_FILE
    saved = RefTable.load(path)
    assert saved is not None and saved.keys == obj.ref_table.keys
    assert torch.equal(saved.logps, obj.ref_table.logps)
    assert (saved.logps[:, :, 0] < 0).all()  # every row's first pair was scored
    if "data.pack=true" in extra:  # packed rows hold 1 or 2 pairs: a row's 2nd column may be 0
        assert saved.logps.shape[2] == 2 and (saved.logps[:, 0, 1] != 0).any()
        assert (saved.logps[:, 0, 1] == 0).any()
    resumed = run_dpo(data + ["dpo.precompute_ref=true"])
    assert resumed["objective"].ref_forwards == 0  # the table was read, not rebuilt
    np.testing.assert_allclose(resumed["losses"], first["losses"], rtol=0, atol=1e-7)


def _precompute_cases(rank: int, world: int, cases: list) -> list:
    out = []
    for overrides in cases:
        run = run_dpo(overrides)
        out.append({"losses": run["losses"], "forwards": run["objective"].ref_forwards,
                    "pair_rows": len(run["objective"].ref_table.keys)})
    return out


def test_precompute_on_dp2_zero3_tp2_and_pp2(pairs_file, tmp_path):  # noqa: F811
    from giantmodel.testing import run_ranks

    data = [f"data.paths=[{pairs_file}]", "dpo.precompute_ref=true"]
    cases = [data + ["dpo.use_lora=true", "parallel.dp=2", "parallel.zero=3",
                     f"run.dir={tmp_path / 'dp'}"],
             data + ["data.pack=true", "parallel.tp=2", f"run.dir={tmp_path / 'tp'}"],
             # the pass walks the pipeline; the last stage reads the table
             data + ["dpo.use_lora=true", "parallel.pp=2", f"run.dir={tmp_path / 'pp'}"],
             data + ["data.pack=true", "parallel.pp=2", f"run.dir={tmp_path / 'ppfull'}"]]
    results = run_ranks(_precompute_cases, 2, cases, timeout=300)[0]
    for overrides, got in zip(cases, results, strict=True):
        live = run_dpo([o for o in overrides if not o.startswith(("parallel.", "dpo.pre"))])
        np.testing.assert_allclose(got["losses"], live["losses"], rtol=1e-5,
                                   err_msg=" ".join(overrides))
        dp = 2 if "parallel.dp=2" in overrides else 1
        # each dp rank scores its share, two pair rows per forward
        assert got["forwards"] == math.ceil(math.ceil(got["pair_rows"] / dp) / 2)
        assert (tmp_path / overrides[-1].split("/")[-1] / TABLE_FILE).exists()


def _setup(overrides: list[str]):
    from giantmodel.config import load_config
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives.dpo import DPO
    from giantmodel.train.trainer import build_engine
    from tests.test_dpo import TINY, TRAIN

    cfg = load_config(overrides=TINY + TRAIN + overrides)
    objective = DPO.from_config(cfg)
    engine = build_engine(cfg, objective, ParallelDims.from_config(cfg, 1), torch.device("cpu"))
    return cfg, objective, engine


def test_the_pass_runs_at_setup_once_the_reference_holds_its_weights(pairs_file, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from giantmodel.config.data import DataConfig
    from giantmodel.core.precision import Precision
    from giantmodel.data.sft_builtin import ensure_tiny_chat_model

    # without init_from the initial draw is final: build_loaders runs the pass
    cfg, obj, engine = _setup([f"data.paths=[{pairs_file}]", "dpo.precompute_ref=true",
                               f"run.dir={tmp_path / 'draw'}"])
    obj.build_loaders(dp_rank=0, dp_size=1)
    assert obj.ref_table is not None and obj.ref_forwards == -(-len(obj.ref_table.keys) // 2)

    model = ensure_tiny_chat_model(DataConfig().resolved_cache_dir())
    shape = ["model.hidden_size=128", "model.num_layers=4", "model.ffn_hidden_size=384",
             "model.max_seq_len=512", "model.norm_eps=1e-5", "model.vocab_size=1024"]
    base = shape + [f"data.paths=[{pairs_file}]", f"checkpoint.init_from={model}"]
    # LoRA: the reference is the base, which load_pretrained fills (after
    # build_loaders, in the trainer): the pass waits for it
    cfg, obj, engine = _setup(base + ["dpo.use_lora=true", "dpo.precompute_ref=true",
                                      f"run.dir={tmp_path / 'lora'}"])
    loader, _ = obj.build_loaders(dp_rank=0, dp_size=1)
    assert obj.ref_table is None and obj.ref_forwards == 0
    obj.load_pretrained(engine.parts, model)
    assert obj.ref_table is not None
    passes = obj.ref_forwards
    engine.forward_backward([next(loader) for _ in range(loader.micro_per_step)],
                            Precision("fp32", "cpu"))
    first = obj.step_metrics()
    assert obj.ref_forwards == passes  # training ran no reference forward
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["rewards/chosen"]) < 1e-6

    # full fine-tuning: the frozen copy holds init_from after build_loaders
    # even when load_pretrained never runs (a resumed run: the policy comes
    # from its checkpoint)
    cfg, obj, engine = _setup(base + [f"run.dir={tmp_path / 'full'}"])
    obj.build_loaders(dp_rank=0, dp_size=1)
    (ref,) = obj._refs.values()
    want = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"]
    got = dict(ref.named_parameters())["tok_embeddings.weight"]
    assert torch.equal(got.detach(), want)
    policy = dict(engine.parts[0].named_parameters())["tok_embeddings.weight"]
    assert not torch.equal(policy.detach(), want)  # the policy is still the initial draw
