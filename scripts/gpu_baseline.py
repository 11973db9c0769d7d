"""A plain PyTorch training loop beside ``giantmodel bench train``.

Hugging Face ``LlamaForCausalLM`` (SDPA attention) with fp32 weights, bf16
autocast, fused AdamW and gradient clipping at 1.0, on the same shape,
sequence length, micro-batch and gradient accumulation as the giantmodel
run it is compared with; random tokens. Prints one JSON line: tokens/s, MFU
(giantmodel's FLOPs formula and peak table, so both sides count the same
work) and peak memory.

    python scripts/gpu_baseline.py --hidden 2048 --layers 16 --heads 32 --kv-heads 8 \\
        --ffn 8192 --vocab 128256 --seq 4096 --micro-batch 1 --accum 8 --tie

Exits 3 (and says so) when transformers is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8),
                          ("ffn", 8192), ("vocab", 128256), ("seq", 4096), ("micro-batch", 1),
                          ("accum", 8), ("warmup", 3), ("steps", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--tie", action="store_true", help="tie the embedding and the head")
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    return p.parse_args()


def build(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.seq, rope_theta=args.rope_theta,
                      tie_word_embeddings=args.tie, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    return model.train()


def step(model, opt, args, torch, gen) -> float:
    total = 0.0
    for _ in range(args.accum):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen)
        ids = ids.to(args.device, non_blocking=True)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                            enabled=args.precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        (loss / args.accum).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total) / args.accum


def main() -> int:
    args = parse()
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: no baseline", file=sys.stderr)
        return 3
    import torch

    from giantmodel.config.model import ModelConfig
    from giantmodel.metrics.flops import flops_per_token, peak_flops

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = build(args, torch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.warmup):
        step(model, opt, args, torch, gen)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, opt, args, torch, gen)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tokens = args.accum * args.micro_batch * args.seq / dt
    shape = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                        vocab_size=args.vocab, max_seq_len=args.seq,
                        tie_embeddings=args.tie)
    peak = peak_flops(device, args.precision)
    mfu = flops_per_token(shape, args.seq) * tokens / peak if peak else 0.0
    print(json.dumps({
        "system": "transformers LlamaForCausalLM + torch AdamW(fused)",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "device": device.type, "precision": args.precision, "seq_len": args.seq,
        "micro_batch": args.micro_batch, "accum": args.accum,
        "params": sum(p.numel() for p in model.parameters()),
        "step_time_s": dt, "tokens_per_sec": tokens, "mfu": mfu, "final_loss": loss,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
