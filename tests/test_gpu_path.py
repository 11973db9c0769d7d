"""The CUDA paths' crash fixes, checked on CPU with device stand-ins, and the
older-torch fallbacks of giantmodel.core.compat, forced on for the check.

- pipeline inputs and targets go to the stage's device (the meta device
  stands in for CUDA: a missed move leaves a CPU tensor);
- each compat probe forced off gives what the new API gives (PipelineStage
  without get_mesh: a pp2 run against one process; varlen without
  enable_gqa: expanded k/v heads against the GQA call);
- the giant group answers torch's look-up of its CUDA backend;
- activation offload under FSDP2 (ZeRO-3) and tp2 (sp: DTensor activations)
  equals no offload, and autocast's weight casts stay on the device;
- CPU-Reduce runs with its tensor's GPU current; two ranks never share a GPU;
- the hang report's own deadline comes before torch's timeouts, and fires.

The multi-rank cases share one ``run_ranks`` spawn.
"""

from __future__ import annotations

import types

import layout_harness as H
import pytest
import torch
import torch.nn.functional as F

from giantmodel.core import compat
from giantmodel.testing import run_ranks


# ------------------------------------------------------------ pipeline inputs
class _Objective:
    def stage_inputs(self, mb):
        return (mb["ids"],), {"positions": mb["pos"]}, mb["labels"]

    def stage_loss(self, out, target):
        self.seen_target = target
        return torch.zeros(())

    def loss_context(self):
        import contextlib

        return contextlib.nullcontext()


def _stub_runner(device):
    from giantmodel.parallel.pipeline import PipelineRunner

    r = PipelineRunner.__new__(PipelineRunner)
    r.objective, r.device = _Objective(), device
    r.plan = types.SimpleNamespace(n_micro=2, num_stages=2)
    r.stage_ids, r.parts = [0, 1], []
    return r


def test_pipeline_inputs_and_targets_move_to_the_stage_device():
    meta = torch.device("meta")
    runner = _stub_runner(meta)
    mbs = [{"ids": torch.zeros(2, 4, dtype=torch.long), "pos": torch.zeros(2, 4, dtype=torch.long),
            "labels": torch.zeros(2, 4, dtype=torch.long)} for _ in range(2)]
    args, kwargs = runner._step_inputs(mbs)
    assert [a.device for a in args] == [meta]
    assert {k: v.device for k, v in kwargs.items()} == {"positions": meta, "target": meta}
    assert args[0].shape == (4, 4)

    seen = {}

    def forward_only(args, kwargs, precision):
        seen["args"], seen["kwargs"] = args, kwargs
        return torch.zeros(2, 4, device=meta)

    runner._forward_only = forward_only
    runner.global_units = lambda batches: 1.0
    runner._reduce_loss = lambda total: 0.0
    runner.eval_loss(mbs[:1], None)
    assert seen["args"][0].device == meta and seen["kwargs"]["positions"].device == meta
    assert runner.objective.seen_target.device == meta


# ----------------------------------------------------------------- compat
def test_probes_answer_and_can_be_forced_off():
    assert set(compat.PROBES) >= {"pipeline_get_mesh", "varlen_enable_gqa", "all_gather_single"}
    for name in compat.PROBES:
        before = compat.has(name)
        with compat.forced_off(name):
            assert compat.has(name) is False
        assert compat.has(name) == before
    with pytest.raises(KeyError):
        compat.has("no_such_api")
    with pytest.raises(KeyError):
        with compat.forced_off("no_such_api"):
            pass


def test_pipeline_stage_drops_get_mesh_when_forced_off(monkeypatch):
    from torch.distributed import pipelining

    calls = []
    monkeypatch.setattr(pipelining, "PipelineStage", lambda *a, **kw: calls.append(kw))
    mesh = object()
    compat.pipeline_stage(None, 0, 2, torch.device("cpu"), group="g", get_mesh=mesh)
    with compat.forced_off("pipeline_get_mesh"):
        compat.pipeline_stage(None, 0, 2, torch.device("cpu"), group="g", get_mesh=mesh)
    assert calls[0] == {"group": "g", "get_mesh": mesh} and calls[1] == {"group": "g"}


def test_expanded_kv_heads_equal_gqa_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 4, generator=g)
    k, v = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ke, ve = compat.expand_kv_heads(k, v, 8, head_dim=1)
    assert ke.shape == (2, 8, 5, 4)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, ke, ve, is_causal=True), ref,
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        compat.expand_kv_heads(k[:, :1].expand(2, 3, 5, 4), v, 8, head_dim=1)


def _fake_varlen(calls):
    """A CPU varlen_attn on [N, H, D] tokens: dense SDPA under the block-
    diagonal causal mask of ``cu`` (window (-1, 0)); GQA only when asked."""
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), **kw):
        calls.append(dict(kw, kv_heads=k.shape[1]))
        assert window_size == (-1, 0)
        if k.shape[1] != q.shape[1]:
            assert kw.get("enable_gqa"), "fewer k/v heads without enable_gqa"
        n = q.shape[0]
        seg = torch.zeros(n, dtype=torch.long)
        seg[cu_q[1:-1].long()] = 1
        seg = seg.cumsum(0)
        mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask,
                                             enable_gqa=bool(kw.get("enable_gqa")))
        return out.transpose(0, 1)
    return varlen_attn


def test_varlen_call_expands_kv_heads_without_enable_gqa(monkeypatch):
    from torch.nn.attention import varlen

    from giantmodel.models.common.masks import (
        DenseMask,
        dense_document_mask,
        masked_attention,
        varlen_segments,
    )

    calls: list = []
    monkeypatch.setattr(varlen, "varlen_attn", _fake_varlen(calls))
    g = torch.Generator().manual_seed(1)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]])
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = varlen_segments(docs)
    new = masked_attention(q, k, v, mask)
    with compat.forced_off("varlen_enable_gqa"):
        old = masked_attention(q, k, v, mask)
    assert calls[0]["enable_gqa"] is True and calls[0]["kv_heads"] == 2
    assert "enable_gqa" not in calls[1] and calls[1]["kv_heads"] == 4
    torch.testing.assert_close(old, new, rtol=0, atol=1e-6)
    dense = masked_attention(q, k, v, DenseMask(dense_document_mask(docs)))
    torch.testing.assert_close(new, dense, rtol=0, atol=1e-5)


def test_collective_aliases_fall_back_to_the_tensor_collectives(monkeypatch):
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **kw: seen.append("ag"))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda *a, **kw: seen.append("rs"))
    with compat.forced_off("all_gather_single"):
        compat.all_gather_single(torch.zeros(2), torch.zeros(1))
        compat.reduce_scatter_single(torch.zeros(1), torch.zeros(2))
    assert seen == ["ag", "rs"]


# ------------------------------------------------------ activation offload
def test_offload_keeps_autocast_weight_casts_on_the_device():
    """Under bf16 autocast the block's weights are cast once per forward;
    those copies are weights, not activations: none may be offloaded."""
    from giantmodel.core.loss import cross_entropy_sum
    from giantmodel.models import build_model, init_weights
    from giantmodel.parallel.offload import ActivationOffload

    cfg = H.make_config("llama", [])
    grads = []
    for use in (False, True):
        model = init_weights(build_model(cfg.model, "meta"), cfg.model, seed=5, device="cpu")
        off = ActivationOffload(list(model.layers.values()), 1, force=True) if use else None
        ids, labels = H.global_batch(cfg, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, n = cross_entropy_sum(model(ids), labels)
        (loss / n).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, rtol=0, atol=0)
    casts = [p.detach().to(torch.bfloat16) for p in model.layers.parameters() if p.dim() == 2]
    hosts = [s.host for slots in off.slots for s in slots]
    assert hosts, "nothing was offloaded"
    for h in hosts:
        for c in casts:
            for cand in (c, c.t()):
                assert not (h.shape == cand.shape and torch.equal(h, cand)), (
                    f"a bf16 weight cast {tuple(h.shape)} went to the host")


# ------------------------------------------------------- multi-rank cases
_OFFLOADS: list = []


def _forced_offload(model, blocks, prefetch_layers):
    """apply_offload with ``force``: on CPU nothing would be copied otherwise."""
    from giantmodel.parallel.offload import ActivationOffload

    off = ActivationOffload(blocks, prefetch_layers, force=True)
    model._activation_offload = off
    _OFFLOADS.append(off)
    return off


def _offloaded() -> dict:
    """What the latest run's offloads copied: tensors, and DTensors among them."""
    slots = [s for off in _OFFLOADS for block in off.slots for s in block]
    _OFFLOADS.clear()
    return {"tensors": len(slots), "dtensors": sum(s.dtensor is not None for s in slots)}


def _giant_cuda_backend(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from giantmodel.comm.backend import GiantProcessGroup

    out = {}
    group = dist.new_group(backend="giant")
    out["plain"] = group._get_backend(torch.device("cuda")) is not None
    real = GiantProcessGroup._make_nccl
    stand_in = {}

    def fake_nccl(store, rank, size, timeout):
        stand_in["pg"] = dist.ProcessGroupGloo(dist.PrefixStore("fake-nccl/", store), rank,
                                              size, timeout)
        return stand_in["pg"]

    GiantProcessGroup._make_nccl = staticmethod(fake_nccl)
    try:
        group2 = dist.new_group(backend="giant")
    finally:
        GiantProcessGroup._make_nccl = real
    cuda_backend = group2._get_backend(torch.device("cuda"))
    cpu_backend = group2._get_backend(torch.device("cpu"))
    # the stand-in answers for cuda and gloo still for cpu
    out["stand_in"] = cuda_backend is stand_in["pg"] and cpu_backend is group2._gloo
    return out


def _hang_early_report(rank: int, world: int, run_dir: str) -> str | None:
    import time

    import torch.distributed as dist

    from giantmodel.train.watchdog import HangWatch

    watch = HangWatch(run_dir, rank, world, timeout_s=3.0)
    if rank == 1:
        time.sleep(3.0)  # a rank stuck before the phase: rank 0 reports meanwhile
    watch.enter("step 0 forward_backward")
    dist.barrier()
    watch.close()
    return watch.early_report


def _dtensor_activation_refused(rank: int, world: int) -> list:
    """A sequence-parallel activation (a DTensor) cannot cross a pipeline of
    a torch without get_mesh: refused with the config key, else passed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    act = DTensor.from_local(torch.zeros(2, 4, 8), mesh, [Shard(1)], run_check=False)
    out = []
    compat.check_plain_activation((act,))
    for value in (act, torch.zeros(2, 8, 8)):
        with compat.forced_off("pipeline_get_mesh"):
            try:
                compat.check_plain_activation(value)
                out.append(None)
            except RuntimeError as e:
                out.append(str(e))
    return out


def _cases(rank: int, world: int, run_dir: str) -> dict:
    import giantmodel.parallel.parallelize as P

    out = {}
    with compat.forced_off("pipeline_get_mesh"):
        out["pp_old"] = H.run_cases(rank, world, [("llama", ["parallel.pp=2"])])[0]
    P.apply_offload = _forced_offload
    for name, layout in (("zero3", ["parallel.dp=2", "parallel.zero=3"]),
                         ("tp2", ["parallel.tp=2", "parallel.sp=true"])):
        pair = [H.run_cases(rank, world, [("llama", layout + extra)])[0]
                for extra in ([], ["offload.activations=true"])]
        out[name] = pair + [_offloaded()]
    out["giant"] = _giant_cuda_backend(rank, world)
    out["dtensor"] = _dtensor_activation_refused(rank, world)
    out["hang"] = _hang_early_report(rank, world, run_dir)
    return out


@pytest.mark.timeout(240)
def test_two_rank_paths(tmp_path):
    results = run_ranks(_cases, 2, str(tmp_path), timeout=200, pg_timeout=30)
    r0 = results[0]
    H.assert_matches(r0["pp_old"], H.reference("llama", []), "pp2 without get_mesh")
    for name in ("zero3", "tp2"):
        plain, offloaded, copied = r0[name]
        assert copied["tensors"] > 0, f"{name}: nothing was offloaded"
        assert (copied["dtensors"] > 0) == (name == "tp2"), (name, copied)
        plain["params"] = {k: torch.as_tensor(v) for k, v in plain["params"].items()}
        H.assert_matches(offloaded, plain, f"{name} offload", loss_rtol=1e-6, param_tol=1e-6)
    for res in results:
        assert res["giant"] == {"plain": True, "stand_in": True}
    refused, plain = r0["dtensor"]
    assert plain is None and refused is not None and "parallel.sp=false" in refused
    report = r0["hang"]
    assert report is not None and "rank 1 did not arrive" in report, report
    assert results[1]["hang"] is None  # one reader: rank 0
    assert (tmp_path / "hang-1.txt").exists()


# --------------------------------------------------------- one GPU per rank
def _fake_cuda(monkeypatch, count: int) -> list:
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    return chosen


def test_more_local_ranks_than_gpus_fail_with_the_fix(monkeypatch):
    from giantmodel.distributed.init import WorldInfo, pick_device

    chosen = _fake_cuda(monkeypatch, 2)
    assert pick_device("cuda", WorldInfo(3, 4, 1, 2)) == torch.device("cuda", 1)
    assert chosen == [1]
    for info in (WorldInfo(2, 4, 2, 3), WorldInfo(0, 4, 0, 3)):
        with pytest.raises(RuntimeError, match="--nproc-per-node 2") as e:
            pick_device("auto", info)
        assert "CUDA_VISIBLE_DEVICES" in str(e.value) and "\n" not in str(e.value)
    assert chosen == [1]


def test_cpu_reduce_runs_on_its_tensors_gpu(monkeypatch):
    import contextlib

    from giantmodel.comm.cuda_reduce import CpuReduce

    current = ["cuda:0"]

    @contextlib.contextmanager
    def device(d):
        prev, current[0] = current[0], str(d)
        yield
        current[0] = prev

    seen = []
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(CpuReduce, "_all_reduce", lambda self, t, *a: seen.append(current[0]))
    reducer = CpuReduce.__new__(CpuReduce)
    reducer.all_reduce(types.SimpleNamespace(device=torch.device("cuda", 3)), 0, 1.0)
    assert seen == ["cuda:3"] and current == ["cuda:0"]


# --------------------------------------------------------- hang deadlines
@pytest.mark.parametrize("heartbeat", [None, "60", "1000"])
def test_hang_report_finishes_before_torch_gives_up(heartbeat):
    from giantmodel.train.watchdog import report_deadlines

    env = {} if heartbeat is None else {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": heartbeat}
    for timeout_s in (3, 10, 60, 600, 1800, 7200):
        d = report_deadlines(timeout_s, env)
        assert d.pg_timeout_s == timeout_s
        assert 0 < d.report_after_s < d.report_done_s < d.killed_s, (timeout_s, d)
        assert d.killed_s <= timeout_s
