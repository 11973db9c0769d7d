"""LoRA training throughput: giantmodel against a plain transformers + peft loop.

Same tiny model (the built-in tiny chat LLaMA, loaded from its Hugging Face
directory by both), same adapters (rank 8, alpha 16, every block linear),
same batches (the bundled instruction set, one example per padded row, taken
from giantmodel's loader so both see identical tokens), same optimizer
(AdamW, fp32, clip 1.0), same threads. Each side runs ``--warmup`` steps, then
``--steps`` timed steps; the figure is tokens/s (padding included, as both
compute it) and the ratio giantmodel / peft. The two sides alternate in
rounds so a change in machine load hits both.

    python benchmarks/lora_throughput.py --steps 20 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

IGNORE = -100


def giantmodel_trainer(run_dir: str, args):
    from giantmodel.config import load_config
    from giantmodel.train.trainer import Trainer

    cfg = load_config("configs/finetune/tiny-lora.yaml", [
        f"run.dir={run_dir}", f"train.steps={10 ** 6}", f"train.seq_len={args.seq_len}",
        f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
        "data.pack=false", "train.eval_every=0", "train.sample_tokens=0", "train.device=cpu",
        f"train.threads={args.threads}", f"data.cache_dir={args.cache}",
        "checkpoint.every=0", "checkpoint.save_final=false", "run.tensorboard=false",
        "run.progress=false", "optim.warmup_steps=0", "optim.schedule=constant",
        # the recipe's min_lr back to the default: a constant schedule refuses a set one
        "optim.min_lr=3e-4"])
    return Trainer(cfg)


def peft_loop(model_dir: str, batches: list[dict], lr: float):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
        task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    state = {"i": 0}

    def step() -> float:
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        logits = model(input_ids=b["input_ids"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(),
                               ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return model, step


def timed(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "giantmodel-bench"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from giantmodel.data.sft_builtin import ensure_tiny_chat_model

    model_dir = str(ensure_tiny_chat_model(args.cache))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = giantmodel_trainer(run_dir, args)
        lr = trainer.cfg.optim.lr
        # The peft side trains on exactly the batches giantmodel's loader yields.
        import copy

        loader = copy.deepcopy(trainer.train_loader)
        total = (args.warmup + args.steps * args.rounds) * trainer.microbatches
        batches = [next(loader) for _ in range(total)]
        _, peft_step = peft_loop(model_dir, batches, lr)
        gm_step = trainer.train_step
        timed(gm_step, args.warmup)
        timed(peft_step, args.warmup)
        gm_t = pf_t = 0.0
        for _ in range(args.rounds):
            gm_t += timed(gm_step, args.steps)
            pf_t += timed(peft_step, args.steps)
        trainer.close()
    tokens = args.steps * args.rounds * args.batch * args.seq_len
    res = {
        "bench": "lora_throughput", "machine": platform.node(), "cpu_count": os.cpu_count(),
        "threads": args.threads, "torch": torch.__version__, "load_avg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": "tiny-chat (llama, 4 layers, hidden 128, vocab 1024)",
        "lora": "rank 8, alpha 16, all block linears", "batch": args.batch,
        "seq_len": args.seq_len, "timed_steps": args.steps * args.rounds,
        "giantmodel_tokens_per_s": tokens / gm_t, "peft_tokens_per_s": tokens / pf_t,
        "ratio": (tokens / gm_t) / (tokens / pf_t),
    }
    print(f"{'side':<12}{'tokens/s':>12}")
    print(f"{'giantmodel':<12}{res['giantmodel_tokens_per_s']:>12,.0f}")
    print(f"{'peft':<12}{res['peft_tokens_per_s']:>12,.0f}")
    print(f"ratio giantmodel/peft = {res['ratio']:.3f}  (load avg {res['load_avg'][0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
