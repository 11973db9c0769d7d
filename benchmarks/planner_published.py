"""Planner predictions against published training throughput, fit and test.

Every row is a published run: model shape, GPUs, global batch, sequence
length, the layout the source states (None where it states none: then the
planner's own best layout on that cluster is used, the question a user asks
it) and the published throughput, with its source.

Split rule, fixed before any fitting: the **fit set** is one source,
Narayanan et al. 2021 (Megatron-LM, Table 1: one code base, one GPU, A100);
the **test set** is every other source. ``--fit`` searches the planner's
tuned constants (GEMM efficiency and its tile knee, fused-attention
efficiency; one set for every GPU) on the fit set only; the default run
reports both sets with the constants in giantmodel/planner/hardware.py, and a
one-parameter baseline on the same rows: a constant MFU (the median of the
fit set's published MFU) times each GPU's peak.

Throughputs published as TFLOP/s per GPU are converted to tokens/s with the
source's own FLOP formula where it gives one (Megatron: with the recompute
pass), else with the planner's model FLOPs (6 N + attention, no recompute).

    PYTHONPATH=. python benchmarks/planner_published.py [--json out.json] [--fit]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace

from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.config.schema import JobConfig
from giantmodel.core.pipeline_split import balanced_split, embedding_cost, head_cost, layer_cost
from giantmodel.planner import hardware
from giantmodel.planner.commands import load_for_planning
from giantmodel.planner.hardware import get_profile
from giantmodel.planner.layout import Cluster, Layout
from giantmodel.planner.memory import memory_report
from giantmodel.planner.perf import PerfOptions, estimate_time, model_flops_per_step
from giantmodel.planner.search import least_recompute_that_fits, search


@dataclass
class Run:
    source: str
    name: str
    model: ModelConfig
    gpu: str
    gpus: int
    global_batch: int
    seq_len: int
    published_tok_s_gpu: float
    layout: dict | None = None
    """tp, pp, cp, zero, sp, recompute, precision, micro_batch, schedule ("1f1b": the
    source's pipeline engine has no interleaving), virtual and stage_layers as the
    source states them (micro-batch, interleaving and an even or cost-balanced split
    searched where it does not; recompute: the least that fits; a tuple for tp or
    zero: the values searched where the source states a kind but not a degree);
    None: the planner's best layout."""
    note: str = ""
    published_memory_gib: float | None = None
    """Peak device memory per GPU the source reports, where it does."""
    opts: PerfOptions | None = None
    """How the source's stack differs from this engine where the planner models it
    (e.g. torchtitan's op-level selective policy re-runs every second matmul)."""

    @property
    def split(self) -> str:
        return "fit" if self.source == NARAYANAN else "test"


def gpt(name, layers, hidden, heads, vocab=51200, seq=2048):
    return ModelConfig(arch="gpt", name=name, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=None, ffn_hidden_size=4 * hidden,
                       vocab_size=vocab, max_seq_len=seq)


def llama(name, layers, hidden, heads, ffn, vocab=32000, kv=None, seq=2048):
    return ModelConfig(arch="llama", name=name, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, ffn_hidden_size=ffn,
                       vocab_size=vocab, max_seq_len=seq)


def megatron_tok_s(tflops: float, m: ModelConfig, seq: int) -> float:
    """Narayanan et al. 2021 eq. 3 (full recompute, so 96 not 72):
    F / token = 96 * L * h^2 * (1 + s/(6h) + V/(16 L h))."""
    L, h, V = m.num_layers, m.hidden_size, m.vocab_size
    per_token = 96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h))
    return tflops * 1e12 / per_token


def model_tok_s(tflops: float, m: ModelConfig, seq: int) -> float:
    """TFLOP/s per GPU -> tokens/s per GPU with the planner's model FLOPs."""
    return tflops * 1e12 / (model_flops_per_step(m, 1, seq) / seq)


RUNS: list[Run] = []

# ------------------------------------------------------------------ fit set
NARAYANAN = ("Narayanan et al. 2021 (SC21, arXiv:2104.04473), Table 1: GPT, A100-80GB, "
             "fp16, full recompute, vocab 51200, seq 2048")
for name, heads, hidden, layers, tp, pp, gpus, batch, tflops in [
        ("gpt-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("gpt-3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
        ("gpt-7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
        ("gpt-18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("gpt-39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138),
        ("gpt-76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        ("gpt-145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        ("gpt-310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        ("gpt-529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        ("gpt-1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163)]:
    m = gpt(name, layers, hidden, heads)
    RUNS.append(Run(NARAYANAN, name, m, "a100-80g", gpus, batch, 2048,
                    megatron_tok_s(tflops, m, 2048),
                    layout={"tp": tp, "pp": pp, "recompute": "full", "precision": "fp16"},
                    note=f"{tflops} TFLOP/s/GPU published"
                         + ("; abstract: 502 PFLOP/s on 3072 GPUs" if gpus == 3072 else "")))

# ----------------------------------------------------------------- test set
LLAMA1 = "Touvron et al. 2023 (LLaMA, arXiv:2302.13971), sec. 2.4 and Table 15, A100-80GB"
# Sec. 2.4: checkpointing that saves the outputs of the linear layers and recomputes the rest
# (this engine's selective), with "model and sequence parallelism as described by Korthikanti
# et al. (2022)" (tensor parallelism with sp); the degrees and data-parallel sharding are not
# stated, so tp 2-8 and zero 0-3 are searched.
LLAMA1_LAYOUT = {"tp": (2, 4, 8), "zero": (0, 1, 2, 3), "sp": True, "recompute": "selective",
                 "precision": "bf16"}
RUNS += [
    Run(LLAMA1, "llama-65b", llama("llama-65b", 80, 8192, 64, 22016), "a100-80g", 2048, 2048,
        2048, 380.0, layout=LLAMA1_LAYOUT,
        note="380 tokens/s/GPU on 2048 GPUs (sec. 2.4)"),
    Run(LLAMA1, "llama-33b", llama("llama-33b", 60, 6656, 52, 17920), "a100-80g", 2048, 2048,
        2048, 1.4e12 / (530432 * 3600), layout=LLAMA1_LAYOUT,
        note="1.4T tokens in 530,432 GPU-hours"),
    Run(LLAMA1, "llama-13b", llama("llama-13b", 40, 5120, 40, 13824), "a100-80g", 2048, 2048,
        2048, 1.0e12 / (135168 * 3600), layout=LLAMA1_LAYOUT,
        note="1.0T tokens in 135,168 GPU-hours"),
]
LLAMA2 = ("Touvron et al. 2023 (Llama 2, arXiv:2307.09288), Table 2 GPU-hours for 2T tokens, "
          "A100-80GB (GPU count not stated: 2048 assumed)")
RUNS += [
    Run(LLAMA2, "llama2-7b", llama("llama2-7b", 32, 4096, 32, 11008, seq=4096), "a100-80g", 2048,
        1024, 4096, 2.0e12 / (184320 * 3600), note="2T tokens in 184,320 GPU-hours"),
    Run(LLAMA2, "llama2-70b", llama("llama2-70b", 80, 8192, 64, 28672, kv=8, seq=4096), "a100-80g",
        2048, 1024, 4096, 2.0e12 / (1720320 * 3600), note="2T tokens in 1,720,320 GPU-hours"),
]
TITAN_A100 = ("torchtitan docs/performance.md (2024): FSDP2 on 64 A100-80GB, bf16; "
              "selective op AC ~ this project's selective, selective layer = every 2nd block full")
L3_8B = llama("llama3-8b", 32, 4096, 32, 14336, vocab=128256, kv=8, seq=8192)
L3_70B = llama("llama3-70b", 80, 8192, 64, 28672, vocab=128256, kv=8, seq=8192)
L2_13B = llama("llama2-13b", 40, 5120, 40, 13824, seq=4096)
L2_70B = llama("llama2-70b", 80, 8192, 64, 28672, kv=8, seq=4096)
EVERY_OTHER = "every-other"
# torchtitan's "selective op" policy (parallelize_llama.py, _apply_ac_to_transformer_block):
# "saves output of all compute ops, except every second mm", counted per block in call
# order wq wk wv wo w1 w3 w2, so wk, wo and w3 are re-run in backward. This engine's
# selective keeps every matmul output; the difference is stated, not fitted.
TITAN_OP_SAC = PerfOptions(selective_matmuls=("wk", "wo", "w3"))
for name, m, seq, mb, rc, wps in [
        ("llama3-8b sel-op", L3_8B, 8192, 1, "selective", 2973),
        ("llama3-8b sel-layer", L3_8B, 8192, 1, EVERY_OTHER, 2904),
        ("llama3-70b full", L3_70B, 8192, 1, "full", 331),
        ("llama2-13b none", L2_13B, 4096, 2, "none", 2162),
        ("llama2-13b sel-layer", L2_13B, 4096, 2, EVERY_OTHER, 1914),
        ("llama2-13b sel-op", L2_13B, 4096, 2, "selective", 1904),
        ("llama2-70b sel-op", L2_70B, 4096, 1, "selective", 355),
        ("llama2-70b full", L2_70B, 4096, 2, "full", 353)]:
    RUNS.append(Run(TITAN_A100, name, m, "a100-80g", 64, 64 * mb, seq, float(wps),
                    layout={"zero": 3, "recompute": rc, "precision": "bf16", "micro_batch": mb},
                    note=f"{wps} WPS, local batch {mb}", opts=TITAN_OP_SAC))
TITAN_H100 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama 3.1 "
              "8B, FSDP, local batch 2, selective AC, no compile; H100 96GB HBM2e 2.4 TB/s, 500 W")
for gpus, tps, gib in ((8, 5762, 82.4), (128, 5605, 67.0)):
    RUNS.append(Run(TITAN_H100, f"llama3.1-8b x{gpus}", L3_8B, "h100-96g-500w", gpus, 2 * gpus,
                    8192, float(tps), published_memory_gib=gib,
                    layout={"zero": 3, "recompute": "selective", "precision": "bf16",
                            "micro_batch": 2},
                    note=f"{tps:,} TPS/GPU, {gib} GiB; profile = h100-sxm with 96 GB at 2.4 TB/s, "
                         "500 W",
                    opts=TITAN_OP_SAC))
MTNLG = ("Smith et al. 2022 (Megatron-Turing NLG 530B with DeepSpeed, arXiv:2201.11990) sec. 2.4, "
         "as restated in llm-analysis's examples/megatron-turing-nlg: 8-way tensor x 35-way pipeline, "
         "global batch 1920 x 2048 tokens, seconds per iteration on 280/350/420 DGX A100")
MT_NLG = gpt("mt-nlg-530b", 105, 20480, 128, vocab=50272)
for nodes, secs, tflops in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)):
    gpus = nodes * 8
    RUNS.append(Run(MTNLG, f"mt-nlg-530b x{gpus}", MT_NLG, "a100-80g", gpus, 1920, 2048,
                    1920 * 2048 / secs / gpus,
                    layout={"tp": 8, "pp": 35, "zero": 1, "recompute": "full",
                            "precision": "bf16", "schedule": "1f1b"},
                    note=f"{secs} s per iteration ({tflops} TFLOP/s/GPU published)"))
BLOOM = ("BigScience BLOOM 176B (bigscience-workshop/bigscience train/tr11-176B-ml/README.md; "
         "bigscience.notion.site BigScience-176B-Model): 384 A100-80GB, Megatron-DeepSpeed, TP 4 x "
         "PP 12 x DP 8, MBS 2, GBS 2048 x 2048 tokens, bf16, ZeRO-1, activation checkpointing, "
         "'about 150 TFLOPs' counted as 8 x params x tokens (hardware FLOPs, with the recompute)")
BLOOM_176B = gpt("bloom-176b", 70, 14336, 112, vocab=250880)
RUNS.append(Run(BLOOM, "bloom-176b x384", BLOOM_176B, "a100-80g", 384, 2048, 2048,
                150e12 / (8 * 176.247e9),
                layout={"tp": 4, "pp": 12, "zero": 1, "recompute": "full", "precision": "bf16",
                        "micro_batch": 2, "schedule": "1f1b",
                        # the README's partition: the tied embedding counts as a block
                        "stage_layers": (5,) + (6,) * 10 + (5,)},
                note="about 150 TFLOP/s/GPU = 8 * 176.2e9 FLOPs per token"))
MEGATRON_V1 = ("Megatron-LM v1.0 (nv-adlr.github.io/MegatronLMV1, 2020), Table 1: GPT-2, batch 8, "
               "tensor parallel on one DGX-2H (V100-SXM3-32GB), iteration times; shapes from the "
               "2019 post's Table 1 (nv-adlr.github.io/MegatronLM), sequence 1024, vocab 51200")
for name, layers, hidden, heads, tp, ms in (("gpt2-1.2b", 40, 1536, 16, 1, 1288),
                                            ("gpt2-4.2b", 64, 2304, 24, 4, 1357)):
    RUNS.append(Run(MEGATRON_V1, f"{name} x{tp}", gpt(name, layers, hidden, heads, seq=1024),
                    "v100-dgx2h", tp, 8, 1024, 8 * 1024 / (ms / 1000) / tp,
                    layout={"tp": tp, "precision": "fp16", "micro_batch": 8},
                    note=f"{ms} ms per iteration of 8 x 1024 tokens"))

LLAMA3 = ("Llama 3 405B pretraining on H100-80GB (Dubey et al. 2024, arXiv:2407.21783, Table 4; "
          "as restated from Balaji, SC'24): TP/CP/PP, 16M tokens per batch, bf16")
L31_405B = llama("llama3.1-405b", 126, 16384, 128, 53248, vocab=128256, kv=8, seq=131072)
# The paper's context parallelism all-gathers K and V and attends each local query chunk
# (two load-balanced chunks per rank); a flash kernel run per chunk with its causal mask skips
# the masked blocks, where this engine's masked SDPA computes the whole rectangle.
LLAMA3_CP = PerfOptions(cp_masked_attention=False)
# Sec. 3.3.2 states two more choices: FSDP keeps the model unsharded from forward to backward,
# with fp32 gradients accumulated over the micro-batches and reduce-scattered in fp32 (this
# engine's zero 2 under pipeline parallelism does the same); and the 8K-token stage ran without
# activation checkpointing (none stated for the 128K stage: the least that fits is searched).
# Its pipeline: interleaved, with one layer fewer on the first and the last rank, "the first model
# chunk on the first stage has only the embedding, and the last model chunk on the last stage
# has only output projection and loss". With 126 layers on 16 ranks and equal chunks between
# those two, that is 8 chunks per rank of one layer each: (16 * 8 - 2) * 1 = 126.
LLAMA3_SPLIT = (0,) + (1,) * 126 + (0,)
for gpus, cp, seq, tflops in ((8192, 1, 8192, 430), (16384, 1, 8192, 400),
                              (16384, 16, 131072, 380)):
    batch = 16 * 2 ** 20 // seq
    RUNS.append(Run(LLAMA3, f"llama3-405b {gpus} cp{cp}", L31_405B, "h100-sxm", gpus, batch, seq,
                    model_tok_s(tflops, L31_405B, seq),
                    layout={"tp": 8, "pp": 16, "cp": cp, "zero": 2, "precision": "bf16",
                            "virtual": 8, "stage_layers": LLAMA3_SPLIT,
                            **({"recompute": "none"} if seq == 8192 else {})},
                    note=f"{tflops} TFLOP/s/GPU published", opts=LLAMA3_CP))

# ------------------------------------------------------- Mixture-of-Experts
# Model FLOPs count the active parameters (6 x active + attention), as Megatron-Core does.
DSV3 = ("DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437): sec. 1 and Table 1, "
        "'each trillion tokens requires only 180K H800 GPU hours, i.e., 3.7 days on our cluster "
        "with 2048 H800 GPUs'; sec. 3.2: 16-way pipeline (DualPipe), 64-way expert parallelism "
        "over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; sec. 3.3: FP8 GEMMs, FP8 "
        "dispatch, bf16 combine; sec. 4.2: sequence 4K, batch 15360 after the ramp-up")
DEEPSEEK_V3 = load_for_planning(f"{__file__.rsplit('/', 2)[0]}/configs/moe/deepseek-v3.yaml",
                                []).model
# DualPipe overlaps each chunk's all-to-all with another chunk's compute; FP8 GEMMs run at
# twice Hopper's bf16 tensor-core peak (attention and elementwise work stay bf16); the dispatch
# moves FP8 rows. Stated by the source, not fitted.
# Sec. 3.2.2: each token reaches at most 4 nodes, crossing InfiniBand once per node, then NVLink.
DSV3_OPTS = PerfOptions(dispatch_bytes=1, moe_comm_overlap=True, gemm_speedup=2.0,
                        node_limited_dispatch=True)
RUNS.append(Run(DSV3, "deepseek-v3 x2048", DEEPSEEK_V3, "h800-sxm", 2048, 15360, 4096,
                1e12 / (180e3 * 3600),
                # sec. 3.2.3: RMSNorm and MLA up-projections recomputed, nothing else
                layout={"pp": 16, "ep": 64, "zero": 1, "precision": "bf16", "schedule": "1f1b",
                        "recompute": "selective"},
                note="180K H800 GPU-hours per trillion tokens (1,543 tokens/s/GPU); DualPipe "
                     "costed as 1F1B", opts=DSV3_OPTS))
QWEN3_MOE = ("Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo) "
             "best_practice/Qwen3/readme.md, Performance Results: Qwen3-235B-A22B, 256 H100, "
             "bf16, seq 4096, GBS 2048, all-to-all dispatcher (A2A), TP2 EP8 PP32 VPP3 DP4, "
             "24.2 s per step, 200 TFLOP/s/GPU")
QWEN3_235B = ModelConfig(arch="llama", family="qwen3_moe", name="qwen3-235b-a22b", hidden_size=4096,
                         num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128, qk_norm=True,
                         ffn_hidden_size=12288, vocab_size=151936, max_seq_len=4096,
                         moe=MoEConfig(num_experts=128, top_k=8, expert_ffn_hidden_size=1536))
# Megatron-Core's expert groups take tp ranks too (EP8 over TP2 x DP4); here ep borrows from
# dp x cp only, so the stated degrees are not a layout of this engine: the planner's best
# layout on the same 256 GPUs is compared, with Megatron's bf16 dispatch.
RUNS.append(Run(QWEN3_MOE, "qwen3-235b-a22b x256", QWEN3_235B, "h100-sxm", 256, 2048, 4096,
                2048 * 4096 / 24.2 / 256,
                note="24.2 s per step of 2048 x 4096 tokens (200 TFLOP/s/GPU published)",
                opts=PerfOptions(dispatch_bytes=2)))


# torchtitan's H100 (Grand Teton): 96 GB HBM2e at 2.4 TB/s, run at a 500 W cap; its note says the
# true peak lies between the SXM (989 TFLOP/s at 700 W) and NVL parts. Dense GEMMs on an H100 run
# at the power limit, and near the top of the DVFS curve voltage tracks clock, so dynamic power goes
# as f^3: the clock, and the peak, scale as (500/700)^(1/3) = 0.89 (884 TFLOP/s bf16, inside the
# stated bracket). A physical rule chosen before comparing, not a fitted factor.
H100_500W_SCALE = (500 / 700) ** (1 / 3)


def _profile(name: str, consts: dict | None = None):
    if name == "h100-96g-500w":
        base = get_profile("h100-sxm")
        hw = replace(base, name=name, memory_bytes=96e9, memory_bw=2.4e12,
                     peak_flops={k: v * H100_500W_SCALE for k, v in base.peak_flops.items()})
    elif name == "h800-sxm":
        # H800: the H100 SXM's compute and memory with NVLink cut to 400 GB/s (200 per
        # direction; DeepSeek-V3 sec. 3.2.2 measures about 160) and 400 Gb/s InfiniBand per
        # GPU (50 GB/s)
        hw = replace(get_profile("h100-sxm"), name=name, intra_bw=200e9, inter_bw=50e9)
    elif name == "v100-dgx2h":
        # DGX-2H: 16 V100-SXM3-32GB at 450 W; the source's 62.4 TFLOP/s is "48% of the
        # theoretical peak" (130 TFLOP/s fp16); NVSwitch 300 GB/s per GPU (150 each way);
        # 100 GB/s per server between servers (6.25 GB/s per GPU)
        base = get_profile("v100-32g")
        hw = replace(base, name=name, peak_flops={**base.peak_flops, "fp16": 130e12},
                     gpus_per_node=16, inter_bw=100e9 / 16)
    else:
        hw = get_profile(name)
    return replace(hw, **(consts or {}))


def _layouts(run: Run, spec: dict):
    """Every layout the spec allows: stated fields fixed, micro-batch and
    schedule searched where unstated."""
    for tp, zero in itertools.product(_options(spec, "tp", 1), _options(spec, "zero", 0)):
        yield from _layouts_at(run, spec, tp, zero)


def _options(spec: dict, key: str, default) -> tuple:
    """A stated value, or the values searched where the source gives a range."""
    value = spec.get(key, default)
    return value if isinstance(value, tuple) else (value,)


def _layouts_at(run: Run, spec: dict, tp: int, zero: int):
    m = run.model
    pp, cp = spec.get("pp", 1), spec.get("cp", 1)
    dp = run.gpus // (tp * pp * cp)
    if dp < 1 or (zero and dp * cp == 1):
        return
    mbs = [spec["micro_batch"]] if "micro_batch" in spec else [1, 2, 4, 8]
    even = run.source == NARAYANAN   # Megatron (2021) needs equal stages
    if "virtual" in spec:
        scheds = [("interleaved_1f1b", spec["virtual"])]
    elif pp == 1 or spec.get("schedule") == "1f1b":
        scheds = [("1f1b", 1)]
    else:
        scheds = [("1f1b", 1)] + [
            ("interleaved_1f1b", v) for v in (2, 3, 4)
            if (m.num_layers % (pp * v) == 0 if even else m.num_layers >= pp * v)]
    for mb, (sched, v) in itertools.product(mbs, scheds):
        if run.global_batch % (mb * dp):
            continue
        n_micro = run.global_batch // (mb * dp)
        if pp > 1 and (n_micro < pp or (v > 1 and n_micro % pp)):
            continue
        split = spec.get("stage_layers") or ((m.num_layers,) if pp * v == 1 else (
            # Megatron splits evenly; the others are balanced by cost
            (m.num_layers // (pp * v),) * (pp * v) if m.num_layers % (pp * v) == 0 else
            tuple(balanced_split(m.num_layers, pp * v, layer_cost(m, run.seq_len),
                                 embedding_cost(m), head_cost(m)))))
        rc = spec.get("recompute", "none")   # unstated: the least that fits, in predict()
        layers = None
        if rc == EVERY_OTHER:
            layers = tuple("full" if i % 2 == 0 else "none" for i in range(m.num_layers))
            rc = "full"
        yield Layout(tp=tp, pp=pp, dp=dp, dp_shard=dp if zero else 1, cp=cp,
                     sp=tp > 1 and spec.get("sp", True),
                     zero=zero, virtual=v, schedule=sched, micro_batch=mb, n_micro=n_micro,
                     seq_len=run.seq_len, precision=spec.get("precision", "bf16"),
                     recompute=rc, offload_activations=False, stage_layers=split,
                     recompute_layers=layers, ep=spec.get("ep", 1))


def predict(run: Run, consts: dict | None = None) -> tuple[float, str]:
    hw = _profile(run.gpu, consts)
    gpn = min(run.gpus, hw.gpus_per_node)   # a run on part of one node
    cluster = Cluster(run.gpus // gpn, gpn)
    opts = run.opts
    if run.layout is not None:
        best = unfit = None
        stated_mb = "micro_batch" in run.layout
        for lay in _layouts(run, run.layout):
            if "recompute" not in run.layout:
                res = least_recompute_that_fits(run.model, lay, hw, cluster, opts)
                if res is None:
                    continue
                lay = res[0]
            fits = _memory(run, lay, hw).fits
            perf = estimate_time(run.model, lay, hw, cluster, run.global_batch, opts)
            cand = (perf.tokens_per_sec, lay.describe() + ("" if fits else " (over memory)"))
            # a published micro-batch is timed as run; a searched one must fit,
            # but for a stated recompute, which is timed as run at the smallest
            # micro-batch when none fits by this engine's memory model
            if not (fits or stated_mb):
                if "recompute" in run.layout and lay.micro_batch == 1 and (
                        unfit is None or cand[0] > unfit[0]):
                    unfit = cand
                continue
            if best is None or cand[0] > best[0]:
                best = cand
        best = best or unfit
        if best is None:
            raise RuntimeError(f"{run.name}: no stated layout fits by the model")
        return best[0] / run.gpus, best[1]
    cfg = JobConfig(model=run.model, precision="bf16")
    cfg.train.global_batch_size, cfg.train.seq_len = run.global_batch, run.seq_len
    cfg.train.micro_batch_size = 1
    # what `giantmodel plan` searches in its 30 s budget, counted in this process's CPU
    # time so that the rows do not depend on other load on the host
    cands = search(cfg, hw, cluster, opts, clock=time.process_time)
    return cands[0].perf.tokens_per_sec / run.gpus, "planner: " + cands[0].layout.describe()


def _memory(run: Run, lay: Layout, hw):
    """The planner's memory for the layout, with the activations the source's
    selective policy re-runs instead of keeping left out."""
    return memory_report(run.model, lay, hw,
                         recomputed=run.opts.selective_matmuls if run.opts else ())


def memory_rows() -> list[dict]:
    """Predicted peak memory per GPU against the sources that report it: the
    stated layout at the stated micro-batch (no search)."""
    out = []
    for run in RUNS:
        if run.published_memory_gib is None:
            continue
        hw = _profile(run.gpu)
        lay = next(iter(_layouts(run, run.layout)))
        peak = _memory(run, lay, hw).peak_bytes_per_rank / 2**30
        out.append({"run": run.name, "layout": lay.describe(), "published_gib": run.published_memory_gib,
                    "predicted_gib": peak, "error": peak / run.published_memory_gib - 1})
    return out


def published_mfu(run: Run) -> float:
    hw = _profile(run.gpu)
    prec = (run.layout or {}).get("precision", "bf16")
    flops_tok = model_flops_per_step(run.model, 1, run.seq_len) / run.seq_len
    return run.published_tok_s_gpu * flops_tok / hw.flops(prec)


def baseline(run: Run, mfu: float) -> float:
    hw = _profile(run.gpu)
    prec = (run.layout or {}).get("precision", "bf16")
    flops_tok = model_flops_per_step(run.model, 1, run.seq_len) / run.seq_len
    return mfu * hw.flops(prec) / flops_tok


def _errors(rows, key="error") -> dict:
    errs = [abs(r[key]) for r in rows]
    return {"n": len(errs), "median": statistics.median(errs), "mean": statistics.fmean(errs),
            "worst": max(errs), "within_15": sum(e <= 0.15 for e in errs)}


def fit(runs: list[Run]) -> dict:
    """Grid search of the tuned constants on the fit rows (mean |error|)."""
    best = None
    grid = itertools.product((0.64, 0.70, 0.76, 0.82, 0.88), (32.0, 64.0, 128.0, 256.0),
                             (0.45, 0.55, 0.65), (0.2, 0.3, 0.4, 0.6))
    for eff, knee, attn, mem in grid:
        consts = {"matmul_efficiency": eff, "matmul_tile_knee": knee, "attention_efficiency": attn,
                  "memory_efficiency": mem}
        errs = [abs(predict(r, consts)[0] / r.published_tok_s_gpu - 1) for r in runs]
        score = (statistics.fmean(errs), max(errs))
        if best is None or score < best[0]:
            best = (score, consts)
        print(f"  eff {eff:.2f} knee {knee:>5.0f} attn {attn:.2f} mem {mem:.2f}: mean "
              f"{score[0] * 100:5.1f}% median {statistics.median(errs) * 100:5.1f}% "
              f"worst {score[1] * 100:5.1f}%", flush=True)
    return best[1]


def ablate(runs: list[Run]) -> None:
    """The fit rows with one earlier rule put back at a time: the GEMM rate
    from the smallest GEMM dimension (0.68 of peak x d / (d + 512)), and the
    bubble as (m + (p - 1) / v) x the slowest stage."""
    from giantmodel.planner import perf, roofline

    def show(label):
        errs = [f"{r.name}:{(predict(r)[0] / r.published_tok_s_gpu - 1) * 100:+.0f}%" for r in runs]
        print(f"{label:<22}", " ".join(errs))

    show("this model")
    est = perf.estimate_time

    def old_bubble(m, layout, hw, cluster, gb, opts=None):
        rep = est(m, layout, hw, cluster, gb, opts)
        extra = ((layout.pp - 1) / perf._fill_drain_divisor(layout) * max(rep.stage_s)
                 - rep.breakdown["bubble"])
        rep.tokens_per_sec = gb * layout.seq_len / (rep.step_s + extra)
        return rep

    globals()["estimate_time"] = old_bubble
    show("old bubble")
    globals()["estimate_time"] = est
    rate = roofline.matmul_rate

    def old_rate(hw, precision, m, k, n):
        d = min(m, k, n)
        return hw.flops(precision) * 0.68 * d / (d + 512)

    roofline.matmul_rate = old_rate   # gemm_time reads it from its module
    show("old GEMM rate")
    roofline.matmul_rate = rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit", action="store_true", help="search the constants on the fit set")
    ap.add_argument("--only", default=None,
                    help="rows whose name contains this text (e.g. deepseek, qwen3)")
    ap.add_argument("--ablate", action="store_true",
                    help="fit rows with the earlier GEMM and bubble rules put back")
    args = ap.parse_args(argv)
    fit_runs = [r for r in RUNS if r.split == "fit"]
    if args.ablate:
        ablate(fit_runs)
        return 0
    if args.fit:
        consts = fit(fit_runs)
        print("best on the fit set:", consts)
        return 0
    mfu = statistics.median(published_mfu(r) for r in fit_runs)
    rows = []
    print(f"{'set':<4} {'run':<22} {'GPUs':>5} {'published':>10} {'planner':>9} {'error':>7} "
          f"{'const-MFU':>9} {'error':>7}  layout")
    for run in RUNS:
        if args.only and args.only not in run.name:
            continue
        pred, lay = predict(run)
        base = baseline(run, mfu)
        row = {"set": run.split, "source": run.source, "run": run.name, "gpu": run.gpu,
               "gpus": run.gpus, "published_tokens_per_sec_per_gpu": run.published_tok_s_gpu,
               "predicted_tokens_per_sec_per_gpu": pred, "error": pred / run.published_tok_s_gpu - 1,
               "baseline_tokens_per_sec_per_gpu": base,
               "baseline_error": base / run.published_tok_s_gpu - 1,
               "published_mfu": published_mfu(run), "layout": lay, "note": run.note}
        rows.append(row)
        print(f"{run.split:<4} {run.name:<22} {run.gpus:>5} {run.published_tok_s_gpu:>10.1f} "
              f"{pred:>9.1f} {row['error'] * 100:>+6.1f}% {base:>9.1f} "
              f"{row['baseline_error'] * 100:>+6.1f}%  {lay}", flush=True)
    summary = {}
    for split in ("fit", "test"):
        sel = [r for r in rows if r["set"] == split]
        if not sel:
            continue
        summary[split] = {"planner": _errors(sel), "baseline": _errors(sel, "baseline_error"),
                          "gpu_kinds": sorted({r["gpu"] for r in sel}),
                          "kinds": sorted({r["gpu"].split("-")[0] for r in sel})}
        p, b = summary[split]["planner"], summary[split]["baseline"]
        print(f"{split}: {p['n']} rows on {len(summary[split]['kinds'])} GPU kinds "
              f"({', '.join(summary[split]['gpu_kinds'])}); planner |error| "
              f"median {p['median'] * 100:.1f}% mean {p['mean'] * 100:.1f}% worst "
              f"{p['worst'] * 100:.1f}%; constant MFU {mfu * 100:.1f}%: median "
              f"{b['median'] * 100:.1f}% mean {b['mean'] * 100:.1f}% worst {b['worst'] * 100:.1f}%")
    print("constants:", {k: getattr(hardware.BUILTIN["a100-80g"], k) for k in
                         ("matmul_efficiency", "matmul_tile_knee", "matmul_k_knee",
                          "attention_efficiency", "memory_efficiency", "link_efficiency")})
    memory = memory_rows()
    for r in memory:
        print(f"memory {r['run']:<20} published {r['published_gib']:.1f} GiB, planner "
              f"{r['predicted_gib']:.1f} GiB ({r['error'] * 100:+.1f}%)  {r['layout']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "baseline_mfu": mfu, "memory": memory},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
