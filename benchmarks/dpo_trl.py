"""giantmodel's objective dpo against TRL's ``DPOTrainer``: the same tiny
model, pairs, batches and hyperparameters, on the CPU, side by side.

* parity: the loss and TRL's metrics (``rewards/*``, ``logps/*``) step by
  step, full fine-tuning in fp32 on both sides (TRL's bf16 autocast and
  gradient-checkpointing defaults switched off; TRL copies the model as
  the reference, giantmodel builds a frozen copy), for ``sigmoid`` and
  ``ipo``;
* speed: tokens/s over the steps after the first (real tokens: padding not
  counted, the same number on both sides), and peak RSS (``VmHWM``) of each
  side's process, with LoRA (TRL: a PEFT model with ``ref_model=None``, the
  adapters disabled for the reference; giantmodel: ``dpo.use_lora``) and
  with full fine-tuning.

TRL runs in its own virtual environment made on first use
(:mod:`benchmarks.peers.venvs`: the system torch reused and pinned, so no
install can replace it with a CUDA build). Each side runs in a fresh
process; batches are taken in file order on both (TRL's sampler set to
sequential), with ``max_length`` = giantmodel's ``train.seq_len + 1`` and
``keep_start`` truncation on both.

Both sides run fp32 without activation recompute (TRL's ``bf16`` and
``gradient_checkpointing`` defaults switched off), each side checked from the
settings it reads back, and said in the output. Speed is taken over
``--reps`` turns per mode; in each, both sides start as fresh processes and,
once both are set up, take turns step by step (the order reversed every
other step), so both see the same host load within a fraction of a second
on a shared host: the median of the per-turn ratios, their spread, and the
quartiles of the per-step ratios.

    python benchmarks/dpo_trl.py --steps 40 --batch 8 --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "trl==1.16.0"
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
TINY_SHAPE = ["model.arch=llama", "model.hidden_size=128", "model.num_layers=4",
              "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=384",
              "model.vocab_size=1024", "model.max_seq_len=512", "model.norm_eps=1e-5"]


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Turns:
    """A side's half of the step-by-step handshake with the driver
    (:func:`run_pair`): ``ready()`` once set up, then each step between
    ``wait()`` (the driver's go) and ``done()``. Without fds (a side run on
    its own) every call returns at once."""

    def __init__(self, spec: dict):
        self.go, self.back = spec.get("go_fd"), spec.get("done_fd")

    def ready(self) -> None:
        self.done()

    def wait(self) -> None:
        if self.go is not None and os.read(self.go, 1) != b"g":
            raise RuntimeError("the driver went away")

    def done(self) -> None:
        if self.back is not None:
            os.write(self.back, b"d")


# --------------------------------------------------------------------------- inputs

def make_inputs(out_dir: Path, num_pairs: int) -> tuple[str, str]:
    """The tiny chat model's directory and a jsonl of ``num_pairs`` bundled
    pairs, each with an explicit prompt (one schema for ``datasets``)."""
    sys.path.insert(0, str(ROOT))
    from giantmodel.config.data import DataConfig
    from giantmodel.data.preference import parse_record
    from giantmodel.data.preference_builtin import tiny_preferences
    from giantmodel.data.sft_builtin import ensure_tiny_chat_model

    model_dir = ensure_tiny_chat_model(DataConfig().resolved_cache_dir())
    train, _ = tiny_preferences(num_train=num_pairs, num_valid=0)
    path = out_dir / "pairs.jsonl"
    with path.open("w") as f:
        for i, rec in enumerate(train):
            prompt, chosen, rejected = parse_record(rec, f"pair {i}")
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return str(model_dir), str(path)


# --------------------------------------------------------------------------- giantmodel side

def giantmodel_side(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from giantmodel.config import load_config
    from giantmodel.core.precision import Precision
    from giantmodel.data.loader import rows_to_batch
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.objectives.dpo import DPO
    from giantmodel.train.trainer import build_engine

    B = spec["batch"]
    overrides = TINY_SHAPE + [
        "objective=dpo", "data.source=preference", f"data.paths=[{spec['data']}]",
        "data.valid_fraction=0", f"checkpoint.init_from={spec['model']}",
        f"train.seq_len={spec['max_length'] - 1}", f"train.global_batch_size={B}",
        f"train.micro_batch_size={B}", "train.device=cpu", "precision=fp32", "recompute=none",
        f"optim.lr={spec['lr']}", "optim.warmup_steps=0", "optim.schedule=constant",
        "optim.weight_decay=0.0", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8",
        "optim.grad_clip=1.0", f"dpo.loss_type={spec['loss_type']}", f"dpo.beta={spec['beta']}",
        "dpo.truncation_mode=keep_start", f"dpo.use_lora={str(spec['lora']).lower()}",
        f"lora.rank={spec['rank']}", f"lora.alpha={spec['alpha']}", "lora.targets=[all_linear]"]
    cfg = load_config(overrides=overrides)
    objective = DPO.from_config(cfg)
    engine = build_engine(cfg, objective, ParallelDims.from_config(cfg, 1), torch.device("cpu"))
    objective.load_pretrained(engine.parts, cfg.checkpoint.init_from)
    loader, _ = objective.build_loaders(dp_rank=0, dp_size=1)
    rows = loader.samples.blended.sources[0].rows  # pair rows in file order
    precision, opt = Precision("fp32", "cpu"), engine.build_optimizer(cfg.optim)
    records, times, tokens = [], [], []
    turns = Turns(spec)
    turns.ready()
    for step in range(spec["steps"]):
        chunk = rows[step * B:(step + 1) * B]
        batch = rows_to_batch(chunk.reshape((2 * B,) + chunk.shape[2:]), packed=True)
        turns.wait()
        t0 = time.perf_counter()
        loss = engine.forward_backward([batch], precision)
        metrics = objective.step_metrics()
        engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.optimizer_step(opt)
        engine.zero_grad(opt)
        times.append(time.perf_counter() - t0)
        turns.done()
        tokens.append(int((batch["document_ids"] >= 0).sum()))
        records.append({"loss": loss, **metrics})
    settings = {"precision": cfg.precision, "recompute": cfg.recompute,
                "recompute_layers": cfg.recompute_layers,
                "param_dtypes": sorted({str(p.dtype) for m in engine.parts for p in m.parameters()})}
    return {"records": records, "times": times, "tokens": tokens, "settings": settings,
            "peak_rss_mb": _peak_rss_mb()}


# --------------------------------------------------------------------------- TRL side

def trl_side(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    data = load_dataset("json", data_files=spec["data"], split="train")
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    records: list[dict] = []
    times: list[float] = []

    class Recording(DPOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            out = super()._compute_loss(model, inputs, return_outputs)
            if self.model.training:
                loss = out[0] if isinstance(out, tuple) else out
                m = self._metrics["train"]
                records.append({"loss": float(loss.detach()), **{k: m[k][-1] for k in METRICS}})
            return out

    turns = Turns(spec)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            turns.ready()

        def on_step_begin(self, args, state, control, **kw):
            turns.wait()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            turns.done()

    with tempfile.TemporaryDirectory() as out:
        # TRL's configs default bf16 to True (unless fp16) and gradient
        # checkpointing to True: accelerate would then run the forward under
        # CPU bf16 autocast (log-probs ~5e-5 relative off fp32, rewards up to
        # 4e-4 off) and recompute every block. Both off: fp32 end to end and
        # the same work per step as giantmodel (no recompute).
        args = DPOConfig(
            bf16=False, fp16=False, gradient_checkpointing=False,
            output_dir=out, per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
            learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            max_grad_norm=1.0, beta=spec["beta"], loss_type=[spec["loss_type"]],
            max_length=spec["max_length"], truncation_mode="keep_start", logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
            train_sampling_strategy="sequential", disable_dropout=True)
        trainer = Recording(model=model, args=args, train_dataset=data, processing_class=tok,
                            peft_config=peft_config, callbacks=[Clock()])
        trainer.train()
        # What actually ran, read back from the trainer rather than from our arguments.
        settings = {"bf16": args.bf16, "fp16": args.fp16,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "model_gradient_checkpointing": bool(
                        getattr(trainer.model, "is_gradient_checkpointing", False)),
                    "mixed_precision": str(trainer.accelerator.mixed_precision),
                    "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}
    return {"records": records, "times": times, "settings": settings,
            "peak_rss_mb": _peak_rss_mb()}


# --------------------------------------------------------------------------- driver

def trl_python() -> Path:
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers.venvs import Peer, ensure

    return ensure(Peer("trl", (TRL_VERSION,)), say=lambda m: print(m, file=sys.stderr))


def run_side(side: str, spec: dict, python: str | Path = sys.executable,
             timeout: float = 900) -> dict:
    """One side in a fresh process (its own peak RSS); the result as a dict."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(spec["threads"]),
               "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([str(python), __file__, "--side", side, "--spec", str(spec_path),
                               "--out", str(out_path)], capture_output=True, text=True,
                              env=env, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} side failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def run_pair(spec: dict, trl_py: Path, timeout: float = 900) -> dict[str, dict]:
    """Both sides at once, each in a fresh process, taking turns step by
    step: once both are set up, the driver lets one run a step, then the
    other (the order reversed every other step), so the two see the same
    host load within a fraction of a second. The result of each side."""
    sides = {"giantmodel": sys.executable, "trl": trl_py}
    procs, pipes = {}, {}
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(spec["threads"]),
               "TOKENIZERS_PARALLELISM": "false"}
        try:
            for side, py in sides.items():
                go_r, go_w = os.pipe()
                done_r, done_w = os.pipe()
                spec_path = Path(d) / f"{side}.spec.json"
                spec_path.write_text(json.dumps({**spec, "go_fd": go_r, "done_fd": done_w}))
                with open(Path(d) / f"{side}.log", "w") as log:
                    procs[side] = subprocess.Popen(
                        [str(py), __file__, "--side", side, "--spec", str(spec_path),
                         "--out", str(Path(d) / f"{side}.out.json")], stdout=log,
                        stderr=subprocess.STDOUT, env=env, pass_fds=(go_r, done_w))
                os.close(go_r)
                os.close(done_w)  # EOF on done_r once the child exits
                pipes[side] = (go_w, done_r)

            def expect(side: str) -> None:
                if os.read(pipes[side][1], 1) != b"d":
                    procs[side].wait(timeout)
                    tail = (Path(d) / f"{side}.log").read_text()[-4000:]
                    raise RuntimeError(f"{side} side failed ({procs[side].returncode}):\n{tail}")

            for side in sides:
                expect(side)  # set up
            for step in range(spec["steps"]):
                for side in (list(sides) if step % 2 == 0 else list(sides)[::-1]):
                    os.write(pipes[side][0], b"g")
                    expect(side)
            out = {}
            for side, proc in procs.items():
                if proc.wait(timeout) != 0:
                    tail = (Path(d) / f"{side}.log").read_text()[-4000:]
                    raise RuntimeError(f"{side} side failed ({proc.returncode}):\n{tail}")
                out[side] = json.loads((Path(d) / f"{side}.out.json").read_text())
            return out
        finally:
            for fds in pipes.values():
                for fd in fds:
                    os.close(fd)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def spec_for(model: str, data: str, *, loss_type: str = "sigmoid", lora: bool = False,
             steps: int = 4, batch: int = 4, threads: int = 1) -> dict:
    return {"model": model, "data": data, "loss_type": loss_type, "lora": lora, "steps": steps,
            "batch": batch, "threads": threads, "lr": 1e-3 if lora else 1e-4, "beta": 0.1,
            "max_length": 96, "rank": 8, "alpha": 16.0}


def tokens_per_s(result: dict, tokens: list[int]) -> float:
    """Over every step but the first (warm-up)."""
    return sum(tokens[1:]) / max(sum(result["times"][1:]), 1e-9)


def check_fp32_no_recompute(gm: dict, trl: dict) -> str:
    """One line saying both sides ran fp32 without recompute, from the
    settings each side read back; raises if either did not."""
    g, t = gm["settings"], trl["settings"]
    bad = []
    if g["precision"] != "fp32" or g["recompute"] != "none" or g["recompute_layers"]:
        bad.append(f"giantmodel {g}")
    if (t["bf16"] or t["fp16"] or t["gradient_checkpointing"] or t["model_gradient_checkpointing"]
            or t["mixed_precision"] != "no"):
        bad.append(f"TRL {t}")
    if g["param_dtypes"] != ["torch.float32"] or t["param_dtypes"] != ["torch.float32"]:
        bad.append(f"parameters giantmodel {g['param_dtypes']}, TRL {t['param_dtypes']}")
    if bad:
        raise RuntimeError("not fp32 without recompute: " + "; ".join(bad))
    return ("both sides fp32 without recompute: giantmodel precision=fp32 recompute=none; TRL "
            "bf16=False fp16=False gradient_checkpointing=False (accelerate mixed_precision=no); "
            "every parameter float32")


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def run_mode(spec: dict, py: Path, reps: int) -> dict:
    """``reps`` turns, each a fresh pair of processes stepping alternately
    (:func:`run_pair`): each turn's ratio (tokens/s over its steps after the
    first), their median and spread, and the per-step ratios' quartiles
    (TRL's step time over giantmodel's on the same batch, back to back)."""
    gms, trls, loads = [], [], []
    for _ in range(reps):
        loads.append(os.getloadavg()[0])
        pair = run_pair(spec, py)
        gms.append(pair["giantmodel"])
        trls.append(pair["trl"])
    tokens = gms[0]["tokens"]
    g_tps = [tokens_per_s(r, tokens) for r in gms]
    t_tps = [tokens_per_s(r, tokens) for r in trls]
    ratios = [g / t for g, t in zip(g_tps, t_tps)]
    steps = sorted(t / g for gm, trl in zip(gms, trls)
                   for g, t in zip(gm["times"][1:], trl["times"][1:]))
    quart = [steps[int(q * (len(steps) - 1))] for q in (0.25, 0.5, 0.75)]
    return {"settings": check_fp32_no_recompute(gms[0], trls[0]),
            "giantmodel_tokens_per_s": g_tps, "trl_tokens_per_s": t_tps, "ratios": ratios,
            "ratio_median": _median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "step_ratio_quartiles": quart,
            "giantmodel_peak_rss_mb": [r["peak_rss_mb"] for r in gms],
            "trl_peak_rss_mb": [r["peak_rss_mb"] for r in trls],
            "loss0_abs_diff": abs(gms[0]["records"][0]["loss"] - trls[0]["records"][0]["loss"]),
            "load_avg_1min": [min(loads), max(loads)], "tokens_per_step": tokens,
            "giantmodel_step_times": [r["times"] for r in gms],
            "trl_step_times": [r["times"] for r in trls]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("giantmodel", "trl"))
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="pairs per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5,
                    help="turns per mode: fresh processes per turn, stepping alternately")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.side:
        fn = giantmodel_side if a.side == "giantmodel" else trl_side
        Path(a.out).write_text(json.dumps(fn(json.loads(Path(a.spec).read_text()))))
        return
    py = trl_python()
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "threads": a.threads, "steps": a.steps, "batch_pairs": a.batch, "reps": a.reps,
           "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        model, data = make_inputs(Path(d), a.steps * a.batch)
        for mode in a.modes.split(","):
            spec = spec_for(model, data, lora=mode == "lora", steps=a.steps, batch=a.batch,
                            threads=a.threads)
            out["cases"][mode] = run_mode(spec, py, a.reps)
            print(f"{mode}: {out['cases'][mode]['settings']}", flush=True)
    print(f"{'mode':6} {'gm tok/s':>9} {'trl tok/s':>9} {'ratio med':>9} {'min-max':>11} "
          f"{'gm MB':>7} {'trl MB':>7} {'|dloss0|':>9}  (medians of {a.reps} turns, steps alternating)")
    for mode, c in out["cases"].items():
        print(f"{mode:6} {_median(c['giantmodel_tokens_per_s']):9.0f} "
              f"{_median(c['trl_tokens_per_s']):9.0f} {c['ratio_median']:8.2f}x "
              f"{c['ratio_min']:5.2f}-{c['ratio_max']:4.2f}x "
              f"{_median(c['giantmodel_peak_rss_mb']):7.0f} {_median(c['trl_peak_rss_mb']):7.0f} "
              f"{c['loss0_abs_diff']:9.2e}  load {c['load_avg_1min'][0]:.1f}-"
              f"{c['load_avg_1min'][1]:.1f}; per step {c['step_ratio_quartiles'][1]:.2f}x "
              f"(quartiles {c['step_ratio_quartiles'][0]:.2f}-{c['step_ratio_quartiles'][2]:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
