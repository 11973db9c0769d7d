"""Megatron-Core's side of the GPU case: the loop of Megatron-LM's
``pretrain_gpt.py`` reduced to what the case needs (GPTModel with RoPE,
SwiGLU, RMSNorm and GQA; Megatron's DDP with its distributed optimizer;
``get_forward_backward_func``), run with the megatron environment's Python.

    <megatron venv>/bin/python benchmarks/peers/megatron_side.py --case gpu-1b --out mc.json

Not run yet: no GPU has been lent to this project (see RESULTS.md).
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


def build(case: workload.Case):
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:  # Transformer Engine kernels when installed, Megatron's local ones otherwise
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec as layer_spec,
        )
    except ImportError:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as layer_spec
    m = workload.model_dict(case)
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_heads"], num_query_groups=m["num_kv_heads"],
        ffn_hidden_size=m["ffn_hidden_size"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16)
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec(),
                     vocab_size=m["vocab_size"], max_sequence_length=m["max_seq_len"],
                     position_embedding_type="rope", rotary_base=int(m["rope_theta"]),
                     share_embeddings_and_output_weights=m["tie_embeddings"]).cuda()
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                            use_distributed_optimizer=True)
    model = DistributedDataParallel(cfg, ddp_cfg, model)
    o = workload.OPTIM
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["beta1"],
        adam_beta2=o["beta2"], adam_eps=o["eps"], clip_grad=o["grad_clip"], bf16=True,
        use_distributed_optimizer=True), [model])
    return model, opt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="gpu-1b")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    case = workload.find_case(a.case)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(workload.SEED)
    model, opt = build(case)
    seq = workload.seq_len(case)
    batches = workload.loader(case, 0, 1)
    n_micro = case.global_batch // case.micro_batch
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(case.micro_batch, seq)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["input_ids"].cuda(), pos, None, labels=mb["labels"].cuda())

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    losses, times = [], []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=batches, model=[model],
                      num_microbatches=n_micro, seq_length=seq, micro_batch_size=case.micro_batch,
                      forward_only=False)
        opt.step()
        losses.append(float(sum(o["loss"] for o in out) / len(out)))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sum(times[a.warmup:]) / len(times[a.warmup:])
    import megatron.core as mc
    result = {"system": "megatron-core", "case": a.case, "version": mc.__version__,
              "tokens_per_sec": case.global_batch * seq / step, "step_s": step,
              "loss": losses[-1], "losses": losses,
              "peak_rss_mib": [round(torch.cuda.max_memory_allocated() / 2**20, 1)]}
    Path(a.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
