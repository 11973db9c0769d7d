"""Checkpoints: DCP round trips, atomicity under failures and kills,
retention, async saves, exact resume, and layout independence (an FSDP2
checkpoint written by 2 ranks loads into one plain process, and back)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from giantmodel.checkpoint import (
    CheckpointManager,
    ModelState,
    OptimizerState,
    PerRank,
    RNGState,
    integrity,
    layout,
    load_model_weights,
)
from giantmodel.config.model import ModelConfig
from giantmodel.config.train import CheckpointConfig
from giantmodel.models import build_model, init_weights

REPO = Path(__file__).resolve().parents[1]




def tiny_cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=64, vocab_size=64, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def make_run(cfg: ModelConfig, seed: int = 0):
    model = init_weights(build_model(cfg), cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train_step(model, opt, sched, cfg: ModelConfig) -> float:
    # data drawn from the global RNG, so restoring RNG state matters
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def full_state(model, model_cfg, opt, sched, extra=None):
    state = {"model": ModelState([model]), "optimizer": OptimizerState([model], opt),
             "lr_scheduler": sched, "rng": RNGState()}
    state.update(extra or {})
    return state


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def assert_same_optimizer(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)


# ---------------------------------------------------------------- single process

def test_round_trip_model_optimizer_scheduler(tmp_path):
    cfg = tiny_cfg(tie_embeddings=True)
    torch.manual_seed(0)
    model, opt, sched = make_run(cfg)
    for _ in range(2):
        train_step(model, opt, sched, cfg)
    counters = {"step": 2, "tokens": 1234}
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(2, full_state(model, cfg, opt, sched, {"train": counters}))
    assert mgr.latest_step() == 2
    step_dir = tmp_path / "checkpoints" / "step-00000002"
    assert (step_dir / ".metadata").is_file() and (step_dir / "ranks" / "rank-00000.pt").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))

    model2, opt2, sched2 = make_run(cfg, seed=1)
    loaded = {"step": 0, "tokens": 0}
    assert mgr.load(full_state(model2, cfg, opt2, sched2, {"train": loaded})) == 2
    assert loaded == counters
    assert model2.output.weight is model2.tok_embeddings.weight  # tie survives the load
    assert_same_model(model, model2)
    assert_same_optimizer(opt, opt2)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_resume_reproduces_losses_exactly(tmp_path, arch):
    """6 steps straight == 3 steps, save, rebuild everything, load, 3 steps:
    every loss equal in fp32 (GPT with dropout, so RNG state matters too)."""
    cfg = tiny_cfg(arch=arch, dropout=0.1 if arch == "gpt" else 0.0,
                   num_kv_heads=None if arch == "gpt" else 2)
    torch.manual_seed(123)
    model, opt, sched = make_run(cfg)
    straight = [train_step(model, opt, sched, cfg) for _ in range(6)]

    torch.manual_seed(123)
    model, opt, sched = make_run(cfg)
    first = [train_step(model, opt, sched, cfg) for _ in range(3)]
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(3, full_state(model, cfg, opt, sched))
    del model, opt, sched
    torch.manual_seed(999)  # a fresh process would start from another RNG state
    model, opt, sched = make_run(cfg, seed=7)
    assert mgr.load(full_state(model, cfg, opt, sched)) == 3
    resumed = first + [train_step(model, opt, sched, cfg) for _ in range(3)]
    assert resumed == straight


def test_failure_mid_save_keeps_latest(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    model, opt, sched = make_run(cfg)
    mgr = CheckpointManager(CheckpointConfig(keep=1), tmp_path, is_rank0=True)
    mgr.save(1, full_state(model, cfg, opt, sched))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    # 1) DCP dies while writing its metadata: the tmp dir is partial
    from torch.distributed.checkpoint import FileSystemWriter

    def broken_finish(self, *a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(FileSystemWriter, "finish", broken_finish)
    with pytest.raises(RuntimeError, match="disk full"):
        mgr.save(2, full_state(model, cfg, opt, sched))
    monkeypatch.undo()
    # 2) data complete, but the process fails before promotion
    monkeypatch.setattr(layout, "fsync_tree", lambda p: (_ for _ in ()).throw(OSError("EIO")))
    with pytest.raises(RuntimeError, match="EIO.*step 1 stays the latest"):
        mgr.save(3, full_state(model, cfg, opt, sched))
    monkeypatch.undo()

    ckpt = tmp_path / "checkpoints"
    assert mgr.latest_step() == 1
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert not (ckpt / "step-00000002").exists() and not (ckpt / "step-00000003").exists()
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000001"]  # no debris
    assert (ckpt / "step-00000001").is_dir()  # retention never ran: nothing good deleted
    fresh, opt2, sched2 = make_run(cfg, seed=5)
    assert CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True).load(
        full_state(fresh, cfg, opt2, sched2)) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    # the next good save applies retention
    mgr.save(4, full_state(model, cfg, opt, sched))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000004"]


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from torch.distributed.checkpoint import FileSystemWriter
    sys.path.insert(0, {tests!r})
    from test_checkpoint import tiny_cfg, make_run, full_state
    from giantmodel.checkpoint import CheckpointManager
    from giantmodel.config.train import CheckpointConfig
    cfg = tiny_cfg()
    model, opt, sched = make_run(cfg)
    mgr = CheckpointManager(CheckpointConfig(keep=1), {run!r}, is_rank0=True)
    mgr.save(1, full_state(model, cfg, opt, sched))
    real_write = FileSystemWriter.write_data
    def write_then_die(self, plan, planner):
        fut = real_write(self, plan, planner)
        fut.wait()
        os.kill(os.getpid(), signal.SIGKILL)  # data files written, no metadata yet
    FileSystemWriter.write_data = write_then_die
    mgr.save(2, full_state(model, cfg, opt, sched))
""")


@pytest.mark.timeout(60)
def test_killed_process_mid_save_leaves_latest_intact(tmp_path):
    script = KILL_SCRIPT.format(tests=str(REPO / "tests"), run=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=False,
                          timeout=50)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    ckpt = tmp_path / "checkpoints"
    tmp = ckpt / "step-00000002.tmp"
    assert tmp.is_dir() and list(tmp.glob("*.distcp"))  # killed half way through
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    assert mgr.latest_step() == 1
    cfg = tiny_cfg()
    model, opt, sched = make_run(cfg, seed=3)
    assert mgr.load(full_state(model, cfg, opt, sched)) == 1
    ref, _, _ = make_run(cfg)
    assert_same_model(model, ref)


def test_retention(tmp_path):
    cfg = tiny_cfg()
    model, _, _ = make_run(cfg)
    ckpt = tmp_path / "checkpoints"
    mgr = CheckpointManager(CheckpointConfig(keep=2), tmp_path, is_rank0=True)
    for step in (10, 20, 30, 40):
        mgr.save(step, {"model": ModelState([model])})
    assert layout.complete_steps(ckpt) == [30, 40] and mgr.latest_step() == 40
    keep_all = CheckpointManager(CheckpointConfig(keep=0), tmp_path / "b", is_rank0=True)
    for step in (1, 2, 3):
        keep_all.save(step, {"model": ModelState([model])})
    assert layout.complete_steps(tmp_path / "b" / "checkpoints") == [1, 2, 3]
    # saving the same step again replaces it atomically
    keep_all.save(3, {"model": ModelState([model])})
    assert layout.complete_steps(tmp_path / "b" / "checkpoints") == [1, 2, 3]


def test_async_save(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    model, opt, sched = make_run(cfg)
    train_step(model, opt, sched, cfg)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = CheckpointManager(CheckpointConfig(async_save=True, keep=1), tmp_path, is_rank0=True)
    mgr.save(1, full_state(model, cfg, opt, sched))
    train_step(model, opt, sched, cfg)  # training goes on while the save runs
    mgr.wait()
    assert mgr.latest_step() == 1
    fresh, opt2, sched2 = make_run(cfg, seed=9)
    assert mgr.load(full_state(fresh, cfg, opt2, sched2)) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k  # the staged snapshot, not later updates
    mgr.save(2, full_state(model, cfg, opt, sched))
    mgr.save(3, full_state(model, cfg, opt, sched))  # waits for step 2 first
    mgr.wait()
    assert layout.complete_steps(tmp_path / "checkpoints") == [3]

    # a background failure surfaces in wait() and never moves latest
    from torch.distributed.checkpoint import FileSystemWriter
    monkeypatch.setattr(FileSystemWriter, "finish",
                        lambda self, *a, **k: (_ for _ in ()).throw(OSError("quota")))
    mgr.save(4, full_state(model, cfg, opt, sched))
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        mgr.wait()
    assert mgr.latest_step() == 3
    mgr.close()


def test_per_rank_fallback_and_weights_only(tmp_path, caplog):
    cfg = tiny_cfg()
    model, _, _ = make_run(cfg)
    import numpy as np
    loader_state = {"epoch": 2, "offset": 17, "order": np.arange(5, dtype=np.int32)}
    counters = {"seen": np.int64(40)}
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(5, {"model": ModelState([model]), "loader": PerRank(loader_state),
                 "counters": counters})
    # pretend the checkpoint came from 2 ranks and this is rank 1 of 4
    meta = tmp_path / "checkpoints" / "step-00000005" / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))
    sums = meta.parent / integrity.CHECKSUMS  # a deliberate edit: record it
    table = json.loads(sums.read_text())["files"]
    table["meta.json"] = integrity.file_checksum(meta)
    integrity.write_checksums(meta.parent, table)
    mgr.rank, mgr.world_size = 1, 4
    target: dict = {}
    rng = RNGState()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    loaded_counters = {"seen": 0}
    with caplog.at_level("WARNING"):
        mgr.load({"loader": PerRank(target), "rng": rng, "counters": loaded_counters})
    assert loaded_counters == {"seen": 40}
    # fell back to rank 0's copy; numpy values survive the restricted unpickler
    assert target.keys() == loader_state.keys() and target["offset"] == 17
    assert np.array_equal(target["order"], loader_state["order"])
    assert target["order"].dtype == np.int32
    assert torch.equal(torch.get_rng_state(), before)  # RNG: skipped, not rank 0's
    assert "saved by 2 ranks and is loaded by 4" in caplog.text

    # weights only: from the run dir, the checkpoints dir and the step dir
    for path in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "step-00000005"):
        other, _, _ = make_run(cfg, seed=4)
        load_model_weights([other], path)
        assert_same_model(model, other)


def test_optimizer_over_several_parts(tmp_path):
    """One optimizer spanning two pipeline-like parts on one rank."""
    cfg = tiny_cfg(num_layers=4)

    def split(model):
        first, last = build_model(cfg, "meta"), build_model(cfg, "meta")
        first.layers = torch.nn.ModuleDict({k: model.layers[k] for k in ("0", "1")})
        last.layers = torch.nn.ModuleDict({k: model.layers[k] for k in ("2", "3")})
        first.tok_embeddings, first.norm, first.output = model.tok_embeddings, None, None
        last.tok_embeddings, last.norm, last.output = None, model.norm, model.output
        return [first, last]

    model, opt, sched = make_run(cfg)
    train_step(model, opt, sched, cfg)
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    parts = split(model)
    mgr.save(1, {"model": ModelState(parts), "optimizer": OptimizerState(parts, opt)})
    # load the two-part checkpoint into a whole model
    whole, opt2, _ = make_run(cfg, seed=8)
    mgr.load({"model": ModelState([whole]), "optimizer": OptimizerState([whole], opt2)})
    assert_same_model(model, whole)
    assert_same_optimizer(opt, opt2)


# ---------------------------------------------------------------- two ranks, FSDP2

def _fsdp_worker(rank: int, world: int, run_a: str, run_b: str):
    """Train an FSDP2 model 2 steps and save (sync, then async); then load
    the single-process checkpoint in run_b into a fresh FSDP2 model."""
    from torch.distributed.fsdp import fully_shard

    cfg = tiny_cfg(tie_embeddings=True)

    def sharded_run(seed):
        model = build_model(cfg, "meta")
        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
        init_weights(model, cfg, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return model, opt, sched

    def full(model, opt):
        # numpy, not tensors: tensors cross the result queue through shared
        # memory that dies with this process
        params = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
        osd = OptimizerState([model], opt).state_dict()
        moments = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).numpy()
                   for k, v in osd.items() if k.startswith("state.")}
        return params, moments

    torch.manual_seed(0)  # same batches on both ranks: the data is not the point
    model, opt, sched = sharded_run(0)
    mgr = CheckpointManager(CheckpointConfig(keep=1, async_save=True), run_a,
                            is_rank0=rank == 0)
    train_step(model, opt, sched, cfg)
    mgr.save(1, full_state(model, cfg, opt, sched))
    train_step(model, opt, sched, cfg)
    mgr.save(2, full_state(model, cfg, opt, sched))
    mgr.wait()
    result = {"saved": full(model, opt), "rng": torch.get_rng_state().numpy()}
    mgr.close()

    model, opt, sched = sharded_run(5)
    CheckpointManager(CheckpointConfig(), run_b, is_rank0=rank == 0).load(
        full_state(model, cfg, opt, sched))
    result["loaded"] = full(model, opt)
    result["local_numel"] = model.layers["0"].attention.wq.weight.to_local().numel()
    del model, opt, sched
    result.update(_tp_and_pipeline_cases(rank, cfg, run_b))
    return result


def _tp_and_pipeline_cases(rank: int, cfg: ModelConfig, run_b: str) -> dict:
    """Load the plain checkpoint into a tensor-parallel model and into a
    two-stage split (each rank one layer), and save both back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    out = {}
    mesh = init_device_mesh("cpu", (2,))
    model = build_model(cfg, "meta")
    plan = {}
    for i in model.layers:
        plan.update({f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")})
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    init_weights(model, cfg, seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    run_b = Path(run_b)
    CheckpointManager(CheckpointConfig(), run_b, is_rank0=rank == 0).load(
        full_state(model, cfg, opt, sched), step=1)
    out["tp_wq_local"] = model.layers["1"].attention.wq.weight.to_local().detach().numpy().copy()
    torch.manual_seed(1)
    out["tp_loss"] = train_step(model, opt, sched, cfg)  # continues as if uninterrupted
    CheckpointManager(CheckpointConfig(), run_b / "tp", is_rank0=rank == 0).save(
        2, full_state(model, cfg, opt, sched))

    # pipeline-style split: rank 0 holds embeddings + layer 0, rank 1 layer 1 + head
    stage = build_model(cfg, "cpu")
    if rank == 0:
        del stage.layers["1"]
        stage.norm = stage.output = None
    else:
        del stage.layers["0"]
        stage.tok_embeddings = None
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    parts = [stage]
    mgr = CheckpointManager(CheckpointConfig(), run_b, is_rank0=rank == 0)
    mgr.load({"model": ModelState(parts), "optimizer": OptimizerState(parts, opt)}, step=1)
    out["pp_keys"] = sorted(stage.state_dict())
    head = stage.output.weight if rank == 1 else stage.tok_embeddings.weight
    out["pp_head"] = head.detach().numpy().copy()
    out["pp_head_moment"] = opt.state[head]["exp_avg"].numpy().copy()
    CheckpointManager(CheckpointConfig(), run_b / "pp", is_rank0=rank == 0).save(
        1, {"model": ModelState(parts), "optimizer": OptimizerState(parts, opt)})
    return out


@pytest.mark.timeout(120)
def test_fsdp2_checkpoint_is_layout_independent(tmp_path):
    from giantmodel.testing import run_ranks

    cfg = tiny_cfg(tie_embeddings=True)
    # single-process checkpoint for the ranks to load (plain -> FSDP2)
    torch.manual_seed(11)
    plain, opt, sched = make_run(cfg, seed=3)
    train_step(plain, opt, sched, cfg)
    run_b = tmp_path / "b"
    CheckpointManager(CheckpointConfig(), run_b, is_rank0=True).save(
        1, full_state(plain, cfg, opt, sched))
    plain_osd = {k: v.clone() if torch.is_tensor(v) else v
                 for k, v in OptimizerState([plain], opt).state_dict().items()}
    plain_at_save = {k: v.clone() for k, v in plain.state_dict().items()}

    run_a = tmp_path / "a"
    results = run_ranks(_fsdp_worker, 2, str(run_a), str(run_b), timeout=110)
    assert results[0]["local_numel"] == 32 * 32 // 2  # really sharded
    assert layout.complete_steps(run_a / "checkpoints") == [2]  # async + retention
    assert sorted(os.listdir(run_a / "checkpoints" / "step-00000002" / "ranks")) == [
        "rank-00000.pt", "rank-00001.pt"]

    # FSDP2 (2 ranks) -> plain single process: exact
    params, moments = results[0]["saved"]
    model, opt2, sched2 = make_run(cfg, seed=6)
    mgr = CheckpointManager(CheckpointConfig(), run_a, is_rank0=True)
    assert mgr.load(full_state(model, cfg, opt2, sched2)) == 2
    assert sched2.last_epoch == 2
    assert torch.equal(torch.get_rng_state(), torch.from_numpy(results[0]["rng"]))  # rank 0's
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.from_numpy(params[k])), k
    osd = OptimizerState([model], opt2).state_dict()
    for k, v in moments.items():
        assert torch.equal(osd[k], torch.from_numpy(v)), k

    # plain -> FSDP2: every rank's gathered state equals the plain one
    for r in results:
        loaded_params, loaded_moments = r["loaded"]
        for k, v in plain.state_dict().items():
            assert torch.equal(torch.from_numpy(loaded_params[k]), v), k
        for k, v in loaded_moments.items():
            assert torch.equal(plain_osd[k], torch.from_numpy(v)), k

    # plain -> tensor parallel: each rank holds its row block of wq
    wq = plain.layers["1"].attention.wq.weight
    for rank, r in enumerate(results):
        assert torch.equal(torch.from_numpy(r["tp_wq_local"]), wq.chunk(2, dim=0)[rank])
    # ... and one more step there equals one more step here; the TP checkpoint
    # then loads into a plain process with the same parameters and moments
    torch.manual_seed(1)
    loss = train_step(plain, opt, sched, cfg)
    assert results[0]["tp_loss"] == pytest.approx(loss, rel=1e-5)
    model, opt3, sched3 = make_run(cfg, seed=12)
    CheckpointManager(CheckpointConfig(), run_b / "tp", is_rank0=True).load(
        full_state(model, cfg, opt3, sched3))
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    osd, ref_osd = OptimizerState([model], opt3).state_dict(), OptimizerState([plain], opt).state_dict()
    for k, v in ref_osd.items():
        if k.startswith("state."):
            torch.testing.assert_close(osd[k], v, rtol=1e-5, atol=1e-6)

    # plain (tied) -> two pipeline stages: each loads only its layers; the
    # last stage's untied head takes the embedding and its optimizer state
    first_keys = sorted([k for k in plain_at_save if k.startswith("layers.0.")]
                        + ["tok_embeddings.weight"])
    assert results[0]["pp_keys"] == first_keys
    assert "output.weight" in results[1]["pp_keys"]
    assert not any(k.startswith("layers.0.") for k in results[1]["pp_keys"])
    emb = plain_at_save["tok_embeddings.weight"]
    emb_moment = plain_osd["state.tok_embeddings.weight.exp_avg"]
    for r in results:
        assert torch.equal(torch.from_numpy(r["pp_head"]), emb)
        assert torch.equal(torch.from_numpy(r["pp_head_moment"]), emb_moment)
    # the union of the two stages' checkpoint is the whole model again
    whole = init_weights(build_model(cfg), cfg, 13)
    opt4 = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    CheckpointManager(CheckpointConfig(), run_b / "pp", is_rank0=True).load(
        {"model": ModelState([whole]), "optimizer": OptimizerState([whole], opt4)})
    for k, v in plain_at_save.items():
        assert torch.equal(whole.state_dict()[k], v), k
    osd = OptimizerState([whole], opt4).state_dict()
    for k, v in plain_osd.items():
        if k.startswith("state."):
            assert torch.equal(osd[k], v), k


def test_load_into_a_different_model_names_the_cause(tmp_path):
    from giantmodel.config.errors import UserInputError

    model, opt, sched = make_run(tiny_cfg())
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(1, full_state(model, tiny_cfg(), opt, sched))
    bigger = tiny_cfg(vocab_size=96)
    other, opt2, sched2 = make_run(bigger)
    with pytest.raises(UserInputError, match=r"Size mismatch .* for model.tok_embeddings.weight.*new run.dir"):
        mgr.load(full_state(other, bigger, opt2, sched2))
    with pytest.raises(UserInputError, match="was the checkpoint saved by a model with this config"):
        load_model_weights([other], tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        CheckpointManager(CheckpointConfig(), tmp_path / "empty", is_rank0=True).load({})
