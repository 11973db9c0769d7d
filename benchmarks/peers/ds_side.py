"""DeepSpeed's side of a peer case, run with the DeepSpeed environment's Python.

    <venv>/bin/python benchmarks/peers/ds_side.py --case dp2-zero1 --steps 20 --out ds.json \
        [--ds-config '{"zero_optimization": {"overlap_comm": true}}'] [--profile]

The model is transformers' LlamaForCausalLM holding giantmodel's initial
weights; batches come from giantmodel's loader (see workload.py). DeepSpeed
runs on its CPU accelerator over gloo with its own defaults: the config names
only the batch plan, the optimizer, clipping and the ZeRO stage. pp2 uses
DeepSpeed's PipelineModule (embedding | 2 decoder layers || 2 decoder layers
| norm + head) and its 1F1B TrainSchedule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workload


def env_for(case: workload.Case) -> dict:
    # On a GPU DeepSpeed detects CUDA itself; here it must be told.
    return {} if case.gpu else {"DS_ACCELERATOR": "cpu"}


def ds_config(case: workload.Case, extra: dict) -> dict:
    o = workload.OPTIM
    gas = case.global_batch // (case.micro_batch * case.dp)
    cfg = {
        "train_batch_size": case.global_batch,
        "train_micro_batch_size_per_gpu": case.micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o["lr"], "betas": [o["beta1"], o["beta2"]], "eps": o["eps"],
            "weight_decay": o["weight_decay"]}},
        "gradient_clipping": o["grad_clip"],
        "zero_optimization": {"stage": case.zero},
        "steps_per_print": 10**9,
    }
    if case.gpu:
        cfg["bf16"] = {"enabled": True}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def _pipeline_layers(hf):
    """LlamaForCausalLM as a flat list of stages' layers for PipelineModule."""
    import torch
    from torch import nn

    class EmbedPipe(nn.Module):
        def __init__(self, embed):
            super().__init__()
            self.embed = embed

        def forward(self, input_ids):
            return self.embed(input_ids)

    class DecoderPipe(nn.Module):
        def __init__(self, layer, rotary):
            super().__init__()
            self.layer = layer
            self.rotary = rotary

        def forward(self, h):
            pos = torch.arange(h.size(1), device=h.device).unsqueeze(0)
            return self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))

    class HeadPipe(nn.Module):
        def __init__(self, norm, head):
            super().__init__()
            self.norm, self.head = norm, head

        def forward(self, h):
            return self.head(self.norm(h))

    m = hf.model
    return ([EmbedPipe(m.embed_tokens)]
            + [DecoderPipe(layer, m.rotary_emb) for layer in m.layers]
            + [HeadPipe(m.norm, hf.lm_head)])


def _build(case: workload.Case, cfg: dict):
    import deepspeed

    hf = workload.hf_llama(case)
    if case.pp > 1:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(_pipeline_layers(hf), num_stages=case.pp,
                               loss_fn=workload.token_loss, partition_method="type:DecoderPipe")
    else:
        model = hf
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=workload.param_groups(model))
    return engine


def _train_step(engine, case, batches, gas: int):
    """One optimizer step; returns the global token-mean loss (for logging, as
    giantmodel's trainer reports it)."""
    import torch
    import torch.distributed as dist
    from stepprofile import phase

    if case.pp > 1:
        with phase("compute"):
            return float(engine.train_batch(data_iter=batches))
    total = torch.zeros((), device=engine.device)
    for _ in range(gas):
        with phase("data"):
            mb = {k: v.to(engine.device) for k, v in next(batches).items()}
        with phase("compute"):
            logits = engine(input_ids=mb["input_ids"], use_cache=False).logits
            loss = workload.token_loss(logits, mb["labels"])
            engine.backward(loss)
        with phase("optimizer"):
            engine.step()  # a real update only at the accumulation boundary
        total += loss.detach()
    dist.all_reduce(total)
    return float(total) / (gas * dist.get_world_size())


class _PipeBatches:
    """(inputs, labels) tuples, the form PipelineEngine.train_batch reads."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        from stepprofile import phase

        with phase("data"):
            mb = next(self.inner)
        return mb["input_ids"], mb["labels"]


def rank_main(rank: int, world: int, case_name: str, steps: int, warmup: int,
              extra: dict, want_profile: bool, bind_cores: bool = False) -> dict:
    import deepspeed
    import torch

    case = workload.find_case(case_name)
    if not case.gpu:
        if bind_cores:   # each rank on its own cores, as `deepspeed --bind_cores_to_rank`
            from giantmodel.distributed.init import WorldInfo, bind_cpu_cores

            bind_cpu_cores(WorldInfo(rank, world, rank, world), threads=1)
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    workload.init_deepspeed("nccl" if case.gpu else "gloo")
    cfg = ds_config(case, extra)
    engine = _build(case, cfg)
    dp_rank = rank // case.pp if case.pp > 1 else rank
    batches = workload.loader(case, 0 if case.pp > 1 else dp_rank, case.dp)
    if case.pp > 1:
        batches = _PipeBatches(batches)
    gas = cfg["gradient_accumulation_steps"]
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(_train_step(engine, case, batches, gas))  # float(): synchronizes
        times.append(time.perf_counter() - t0)
    rss = workload.peak_memory_bytes(engine.device)
    prof = None
    if want_profile:
        from stepprofile import profile_step

        prof = profile_step(lambda: _train_step(engine, case, batches, gas))
    opt = type(engine.optimizer).__name__
    inner = getattr(engine.optimizer, "optimizer", None)
    return {"losses": losses, "step_times": times[warmup:], "peak_rss": rss,
            "profile": prof if rank == 0 else None,
            "optimizer": opt + (f"({type(inner).__name__})" if inner is not None else ""),
            "deepspeed": deepspeed.__version__, "ds_config": cfg}


def _import_once() -> None:
    """What every case would load again, loaded once before the cases fork:
    DeepSpeed, transformers' LLaMA, and DeepSpeed's CPU ops (a JIT load checks
    the build with ninja: about 2.7 s per process on this host)."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    for op in ("FusedAdamBuilder", "ShareMemCommBuilder"):
        get_accelerator().create_op_builder(op).load()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", help="the case (not with --serve)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ds-config", default="{}", help="JSON merged over the default config")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--bind-cores", action="store_true",
                   help="pin each rank to its own share of the CPUs, as DeepSpeed's launcher "
                        "does with --bind_cores_to_rank")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--serve", action="store_true",
                   help="be one rank (RANK/WORLD_SIZE/MASTER_ADDR from the environment, as "
                        "srun or the emulated cluster start it) serving the suite's commands "
                        "on stdin (benchmarks/peers/launch.py); CPU cases only")
    p.add_argument("--out", help="the JSON to write (not with --serve)")
    a = p.parse_args()
    if a.serve:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
        os.environ.update(env_for(workload.CPU_CASES[0]))
        _import_once()

        def one(name, dest, steps, profile):
            r = rank_main(rank, world, name, steps, a.warmup, json.loads(a.ds_config), profile,
                          a.bind_cores)
            Path(f"{dest}.rank{rank}").write_text(json.dumps(r))
        return workload.serve(one)
    if not (a.case and a.out):
        p.error("--case and --out are needed without --serve")
    case = workload.find_case(a.case)
    os.environ.update(env_for(case))
    from giantmodel.testing import run_ranks

    t0 = time.perf_counter()
    per_rank = run_ranks(rank_main, case.ranks, a.case, a.steps, a.warmup,
                         json.loads(a.ds_config), a.profile, a.bind_cores, backend=None,
                         timeout=a.timeout,
                         env={**env_for(case), "LOCAL_SIZE": str(case.ranks)})
    result = {"wall_s": time.perf_counter() - t0, "load_avg": workload.load_avg(),
              **summarize(case, per_rank)}
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


def summarize(case: workload.Case, per_rank: list[dict]) -> dict:
    """One run's figures from its ranks' results (the slowest rank sets the step)."""
    step = max(sum(r["step_times"]) / len(r["step_times"]) for r in per_rank)
    r0 = per_rank[0]
    return {"system": "deepspeed", "case": case.name,
            "tokens_per_sec": case.global_batch * workload.seq_len(case) / step, "step_s": step,
            "loss": r0["losses"][-1], "losses": r0["losses"],
            "peak_rss_mib": [round(r["peak_rss"] / 2**20, 1) for r in per_rank],
            "profile": r0["profile"],
            "settings": {"deepspeed": r0["deepspeed"], "optimizer": r0["optimizer"],
                         "config": r0["ds_config"]}}


if __name__ == "__main__":
    sys.exit(main())
