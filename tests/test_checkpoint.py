"""Checkpoints: DCP round trips, atomicity under failures and kills,
retention, async saves, exact resume, and layout independence (an FSDP2
checkpoint written by 2 ranks loads into one plain process, and back)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from giantmodel.checkpoint import (CheckpointManager, ModelState, OptimizerState, PerRank,
                                   RNGState, load_model_weights)
from giantmodel.checkpoint import layout
from giantmodel.config.model import ModelConfig
from giantmodel.config.train import CheckpointConfig
from giantmodel.models import build_model, init_weights

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: a second intra-op thread only adds spin-waiting on a busy host.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    with pytest.raises(OSError, match="EIO"):
        mgr.save(3, full_state(model, cfg, opt, sched))
    monkeypatch.undo()

    ckpt = tmp_path / "checkpoints"
    assert mgr.latest_step() == 1
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert not (ckpt / "step-00000002").exists() and not (ckpt / "step-00000003").exists()
    assert (ckpt / "step-00000003.tmp").is_dir()  # left behind, never promoted
    assert (ckpt / "step-00000001").is_dir()  # retention never ran: nothing good deleted
    fresh, opt2, sched2 = make_run(cfg, seed=5)
    assert CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True).load(
        full_state(fresh, cfg, opt2, sched2)) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    # the next good save clears the debris and applies retention
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
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
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
    model, opt, sched = make_run(cfg)
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
    model, opt, sched = make_run(cfg)
    loader_state = {"epoch": 2, "offset": 17}
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, is_rank0=True)
    mgr.save(5, {"model": ModelState([model]), "loader": PerRank(loader_state)})
    # pretend the checkpoint came from 2 ranks and this is rank 1 of 4
    meta = tmp_path / "checkpoints" / "step-00000005" / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))
    mgr.rank, mgr.world_size = 1, 4
    target: dict = {}
    rng = RNGState()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    with caplog.at_level("WARNING"):
        mgr.load({"loader": PerRank(target), "rng": rng})
    assert target == loader_state  # fell back to rank 0's copy
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
        params = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        osd = OptimizerState([model], opt).state_dict()
        moments = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
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
    result = {"saved": full(model, opt), "rng": torch.get_rng_state()}
    mgr.close()

    model, opt, sched = sharded_run(5)
    CheckpointManager(CheckpointConfig(), run_b, is_rank0=rank == 0).load(
        full_state(model, cfg, opt, sched))
    result["loaded"] = full(model, opt)
    result["local_numel"] = model.layers["0"].attention.wq.weight.to_local().numel()
    return result


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
    plain_osd = OptimizerState([plain], opt).state_dict()

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
    assert torch.equal(torch.get_rng_state(), results[0]["rng"])  # rank 0's stream
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    osd = OptimizerState([model], opt2).state_dict()
    for k, v in moments.items():
        assert torch.equal(osd[k], v), k

    # plain -> FSDP2: every rank's gathered state equals the plain one
    for r in results:
        loaded_params, loaded_moments = r["loaded"]
        for k, v in plain.state_dict().items():
            assert torch.equal(loaded_params[k], v), k
        for k, v in loaded_moments.items():
            assert torch.equal(plain_osd[k], v), k
