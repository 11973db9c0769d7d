"""Per-token terms of the activation model: what one transformer block of
this project keeps for backward, tensor by tensor (the memory model,
:mod:`giantmodel.planner.memory`, sums them per layout)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Term:
    """One tensor saved for backward, per token of the local sequence."""

    name: str
    bytes_per_token: float
    split: str
    """'tp': split by tensor parallelism; 'seq': split by tp only under sequence
    parallelism (norm/residual region); 'full': neither (gathered linear inputs)."""
    kv: bool = False
    """K/V tensor: all-gathered over context parallelism, so cp times longer."""


def layer_terms(m, precision: str, lora: tuple[int, tuple[str, ...]] | None = None
                ) -> list[Term]:
    """Saved tensors of one transformer block (see the module docstring), as
    :mod:`giantmodel.models.common.fused` keeps them. The residual stream is
    in the compute dtype (``c`` bytes), so are the norms' outputs, and each
    is saved once: RMSNorm keeps its input and an fp32 rstd; the fused
    q|k|v and gate|up GEMMs keep their one input (sharded along the
    sequence under sp: 'seq'); the gated activation keeps gate and up.
    ``lora`` = (rank, adapted paths): the block's base is frozen (see
    :func:`_frozen_base_terms`). GPT's LayerNorm keeps its
    input, mean and rstd; its MLP (an autocast linear) reads the norm's
    compute-dtype output without a cast."""
    c = DTYPE_BYTES[precision]
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv, n = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head, m.num_heads
    terms = []
    if m.arch == "llama":
        def norm(p):  # RMSNorm: its input as it came, one fp32 rstd per row
            return [Term(f"{p}.input", c * h, "seq"), Term(f"{p}.rstd", 4, "seq")]
        terms += norm("attention_norm")
        if m.mla is not None:
            terms += mla_terms(m, precision)
        else:
            terms += [Term("attention.input", c * h, "seq")]
            if m.qk_norm:
                terms += qk_norm_terms(m, precision)
            terms += [Term("attention.q_rope", c * q, "tp"),
                      Term("attention.k_rope", c * kv, "tp", kv=True)]
            if not m.qk_norm:   # with qk-norm v is a view of the kept q|k|v output
                terms.append(Term("attention.v", c * kv, "tp", kv=True))
            terms += [Term("attention.lse", 4 * n, "tp"),
                      # SDPA's output, laid out [B, T, H, D]: wo's input is a view of it
                      Term("attention.core_out", c * q, "tp")]
        terms += norm("ffn_norm")
        if m.moe is not None:   # the shared experts read the normed stream as a SwiGLU does
            terms += moe_ffn_terms(m, precision)
        else:
            terms += [Term("feed_forward.input", c * h, "seq"),
                      Term("feed_forward.w1_out", c * f, "tp"),
                      Term("feed_forward.w3_out", c * f, "tp"),
                      Term("feed_forward.w2_input", c * f, "tp")]
        if m.post_norms:   # Gemma's norms on the attention's and the MLP's outputs
            terms += post_norm_terms(terms)
    else:
        def norm(p):  # LayerNorm (fused.LayerNorm): its input, fp32 mean and rstd
            return [Term(f"{p}.input", c * h, "seq"), Term(f"{p}.stats", 8, "seq")]
        terms += norm("attention_norm")
        # no RoPE: q, k and v stay views of the one kept q|k|v output
        terms += [Term("attention.input", c * h, "seq"),
                  Term("attention.q", c * q, "tp"), Term("attention.k", c * kv, "tp", kv=True),
                  Term("attention.v", c * kv, "tp", kv=True),
                  Term("attention.lse", 4 * n, "tp"),
                  Term("attention.core_out", c * q, "tp")]
        terms += norm("ffn_norm")
        terms += [Term("feed_forward.input", c * h, "full"),
                  Term("feed_forward.w1_out", c * f, "tp"),
                  Term("feed_forward.w2_input", c * f, "tp")]
        if m.dropout > 0:  # CUDA dropout keeps a 1-byte mask per element
            terms += [Term("dropout.masks", 2 * h, "seq"), Term("attention.dropout_rng", 0, "tp")]
    return terms if lora is None else _frozen_base_terms(m, terms, c, *lora)


def qk_norm_terms(m, precision: str) -> list[Term]:
    """Qwen3's per-head RMSNorm of q and k (before RoPE): each keeps its
    input, a view of the fused q|k|v output (kept whole, once), and one
    fp32 rstd per head. Local to the rank: the keys are normalised before
    context parallelism gathers them."""
    c = DTYPE_BYTES[precision]
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    return [Term("attention.qkv_out", c * (q + 2 * kv), "tp"),
            Term("attention.q_norm.rstd", 4 * m.num_heads, "tp"),
            Term("attention.k_norm.rstd", 4 * m.kv_heads, "tp")]


# Which linears read each saved linear input (the block's q/k/v and MLP inputs).
_LINEAR_INPUTS = {"attention.input": ("attention.wq", "attention.wk", "attention.wv"),
                  "feed_forward.input": ("feed_forward.w1", "feed_forward.w3"),
                  "feed_forward.w2_input": ("feed_forward.w2",)}


def _frozen_base_terms(m, terms: list[Term], c: int, rank: int,
                       paths: tuple[str, ...]) -> list[Term]:
    """LoRA: the base is frozen, so a linear's input is kept only for a
    gradient: a group of linears with an adapter runs their own forward,
    and the adapters keep the input whole (gathered under tp: they take it
    replicated); a group without one (the fused GEMM, or GPT's plain MLP
    linear) keeps none, as no weight of it trains. Each adapter adds its
    rank-r ``A x`` (B's input). The norms keep their inputs anyway."""
    out = []
    for t in terms:
        readers = _LINEAR_INPUTS.get(t.name)
        if readers is not None:
            if m.arch == "gpt" and t.name == "feed_forward.input":
                readers = ("feed_forward.w1",)
            if not any(r in paths for r in readers):
                continue
            t = Term(t.name, t.bytes_per_token, "full" if t.split == "seq" else t.split)
        out.append(t)
    # A x is [tokens, r] whole on every tp rank (A's row-parallel partial
    # sums are reduced); adapter dropout (lora.dropout > 0) is not counted.
    out += [Term(f"{p}.lora_ax", c * rank, "full") for p in paths]
    return out


def sp_recomputed_matmuls(m, tp: int, sp: bool) -> tuple[str, ...]:
    """The row-parallel matmuls whose outputs the selective policy re-runs
    under sequence parallelism (giantmodel.parallel.sp_linear: their
    full-length partial sums are not kept, their reduce-scatter results
    are): attention's wo, and LLaMA's w2 (GPT's MLP keeps its plan)."""
    if tp <= 1 or not sp or m.mla is not None:
        return ()
    return ("wo", "w2") if m.arch == "llama" and m.moe is None else ("wo",)


def selective_terms(m, precision: str, tp: int, sp: bool, cp: int) -> list[Term]:
    """What the selective policy keeps per block (giantmodel.parallel.recompute):
    the block input (the checkpoint's), every matmul output (under tp the
    row-parallel ones are partial sums), the fused attention kernel's output
    and log-sum-exp, and under sp the reduce-scatter results. Norms, casts,
    rotary, the MLP activation, the tp all-reduce and the sp/cp all-gathers
    are recomputed.

    Under context parallelism (no attention dropout) each chunk's attention
    is two fused kernels, the keys before it and its causal diagonal block
    (giantmodel.parallel.context._SplitCausalAttention): the policy keeps
    both kernels' outputs and log-sum-exps and recomputes their merge, so
    core_out and lse count twice. Exact on every cp rank but the first,
    whose first chunk is one causal kernel (3/4 of it)."""
    c = DTYPE_BYTES[precision]
    h, f, n = m.hidden_size, m.ffn_hidden_size, m.num_heads
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    parts = 2 if cp > 1 and not cp_masked_attention(m) else 1
    terms = [Term("block.input", c * h, "seq")]   # the residual, in the compute dtype
    if m.mla is not None:
        terms += mla_selective_terms(m, precision)
    else:
        terms += [Term("attention.wq_out", c * q, "tp"), Term("attention.wk_out", c * kv, "tp"),
                  Term("attention.wv_out", c * kv, "tp"),
                  Term("attention.core_out", parts * c * q, "tp"),
                  Term("attention.lse", parts * 4 * n, "tp"),
                  Term("attention.wo_out", c * h, "full")]   # partial sums under tp
    if m.moe is not None:
        terms += moe_selective_terms(m, precision)
    else:
        terms += [Term("feed_forward.w1_out", c * f, "tp"),
                  Term("feed_forward.w2_out", c * h, "full")]
        if m.arch == "llama":
            terms.append(Term("feed_forward.w3_out", c * f, "tp"))
    if tp > 1 and sp:   # reduce-scatter results of wo and w2
        terms += [Term("attention.wo_reduced", c * h, "seq"),
                  Term("feed_forward.w2_reduced", c * h, "seq")]
    rerun = {f"{'attention' if n == 'wo' else 'feed_forward'}.{n}_out"
             for n in sp_recomputed_matmuls(m, tp, sp)}
    return [t for t in terms if t.name not in rerun]


def term_bytes(t: Term, tokens: float, tp: int, sp: bool, cp: int) -> float:
    div = tp if (t.split == "tp" or (t.split == "seq" and sp)) else 1
    return tokens * t.bytes_per_token / div * (cp if t.kv else 1)


def cp_masked_attention(m) -> bool:
    """Whether context-parallel attention takes its masked SDPA call
    (attention dropout, GPT only) instead of the split fused kernels."""
    return m.arch != "llama" and m.dropout > 0


def cp_none_terms(m, precision: str, micro_batch: int, seq_len: int, tp: int, cp: int,
                   lora) -> dict[str, float]:
    """What context-parallel attention keeps beyond ``layer_terms`` without
    recompute (giantmodel.parallel.context). The chunks' outputs are
    concatenated along the sequence and copied into wo's [B, T, H*D] input,
    so the outputs attention saves (the split kernels' merged output, or
    SDPA's) and wo's input are two tensors, not one; a frozen wo (LoRA
    without a wo adapter) keeps no input. The index putting the gathered
    keys in position order (int64 [s]) is kept by their index_select. The
    masked call (attention dropout) keeps each chunk's boolean mask [c, end]:
    c^2 (2cp + 1) on every rank but the first, c = s / (2cp)."""
    tokens = micro_batch * seq_len / cp
    out = {"attention.cp_key_order": 8.0 * seq_len}
    if lora is None or "attention.wo" in lora[1]:
        q = m.num_heads * m.dim_per_head
        out["attention.wo_input"] = tokens * DTYPE_BYTES[precision] * q / tp
    if cp_masked_attention(m):
        chunk = seq_len / (2 * cp)
        out["attention.cp_mask"] = chunk * chunk * (2 * cp + 1)
    return out


# ------------------------------------------------- MoE and latent attention
def routed_rows_per_token(m) -> float:
    """Expert rows one local token creates on the rank its experts run on:
    top_k under balanced dropless routing, capped by a capacity factor below 1."""
    cf = m.moe.capacity_factor
    return m.moe.top_k * (min(1.0, cf) if cf is not None else 1.0)


def moe_ffn_terms(m, precision: str) -> list[Term]:
    """What one MoE feed-forward keeps for backward, per local token (no
    recompute), as giantmodel.models.common.moe runs it. The whole layer
    runs on every tp rank (parallel.tensor's MoE plan: not split by tp),
    so every term is 'full'.

    * Router (fp32): the gate's ``F.linear`` keeps its fp32 input (a copy
      of the compute-dtype rows; in fp32 the rows themselves), the
      softmax's or sigmoid's output [N, E], the top-k ids (kept by the
      gather of the chosen scores); renormalised weights keep the gathered
      scores and their sum; the combine keeps the weights (cast to the
      compute dtype). The logits only under the z-loss (its logsumexp keeps
      them and its result), a sigmoid router's per-token score sum only
      under a balance loss (its probabilities' division keeps it).
    * Dispatch: the sort order and its inverse (int64, one per routed row,
      kept by the two row gathers), the gathered rows (the CPU loop keeps
      them; the grouped GEMM keeps its padded copy: alignment rows aside,
      the same bytes; it also keeps the gather index back, 8 bytes a
      routed row, not counted), each expert's gate and up outputs, SiLU
      output and gated product per routed row, and the combine's [N, k, h]
      expert outputs.
    * Shared experts: a fused SwiGLU as the dense FFN (its input, one
      gate|up output, the gated product); in fp32 its input is the
      router's."""
    c = DTYPE_BYTES[precision]
    moe, h = m.moe, m.hidden_size
    k, e = moe.top_k, moe.num_experts
    f = moe.expert_width(m.ffn_hidden_size)
    rows = routed_rows_per_token(m)
    terms = [Term("moe.router_input", 4 * h, "full"), Term("moe.router_scores", 4 * e, "full"),
             Term("moe.topk_ids", 8 * k, "full")]
    if moe.z_loss_coeff > 0:
        terms.append(Term("moe.router_logits", 4 * e + 4, "full"))
    if moe.router == "sigmoid" and (moe.aux_loss_coeff > 0 or moe.seq_aux_loss_coeff > 0):
        terms.append(Term("moe.router_score_sum", 4, "full"))
    if moe.norm_topk_prob:
        terms.append(Term("moe.gate_weights", 4 * k + 4, "full"))
    terms += [Term("moe.combine_weights", c * k, "full"),
              Term("moe.sort_order", 2 * 8 * k, "full"),
              Term("moe.dispatched", c * rows * h, "full"),
              Term("moe.experts.w1_out", c * rows * f, "full"),
              Term("moe.experts.w3_out", c * rows * f, "full"),
              Term("moe.experts.silu", c * rows * f, "full"),
              Term("moe.experts.w2_input", c * rows * f, "full"),
              # the combine's [N, k, h] expert outputs, kept by its weighted sum
              Term("moe.combine_in", c * k * h, "full")]
    if moe.num_shared_experts:
        fs = moe.shared_width(m.ffn_hidden_size)
        if c < 4:
            terms.append(Term("moe.shared.input", c * h, "full"))
        terms += [Term("moe.shared.w1_out", c * fs, "full"), Term("moe.shared.w3_out", c * fs, "full"),
                  Term("moe.shared.w2_input", c * fs, "full")]
    return terms


def moe_selective_terms(m, precision: str) -> list[Term]:
    """What the selective policy keeps of an MoE feed-forward: the matmul
    outputs (the router's fp32 logits, expert and shared-expert GEMMs), the
    dispatched rows that crossed the all-to-all (the collective's result),
    the combine's input. In bf16 the experts run as grouped GEMMs on the GPU,
    whose down projection's output is a matmul output too (the CPU loop
    writes it in place, not kept)."""
    keep = {"moe.dispatched", "moe.experts.w1_out", "moe.experts.w3_out",
            "moe.combine_in", "moe.shared.w1_out", "moe.shared.w3_out"}
    terms = [Term("moe.router_logits", 4 * m.moe.num_experts, "full")] + [
        t for t in moe_ffn_terms(m, precision) if t.name in keep]
    if precision == "bf16":
        rows = routed_rows_per_token(m)
        terms.append(Term("moe.experts.w2_out", DTYPE_BYTES[precision] * rows * m.hidden_size,
                          "full"))
    return terms


def mla_terms(m, precision: str) -> list[Term]:
    """What one multi-head latent attention keeps for backward, per token (tp
    is refused with MLA, so nothing is split): its input (the compute-dtype
    norm output, read by wq_a and wkv_a without casts), the low-rank latents
    (kept by their RMSNorms with an fp32 rstd) and the normed latents (the
    up-projections' input), the expanded q, k and v, the kernel's output and
    log-sum-exp."""
    c = DTYPE_BYTES[precision]
    a, heads = m.mla, m.num_heads
    qk, v = heads * a.qk_head_dim, heads * a.v_head_dim
    terms = [Term("attention.input", c * m.hidden_size, "full")]
    if a.q_lora_rank is not None:
        r = a.q_lora_rank
        terms += [Term("attention.q_latent", c * r, "full"), Term("attention.q_normed", c * r, "full"),
                  Term("attention.q_latent_rstd", 4, "full")]
    r = a.kv_lora_rank
    terms += [Term("attention.kv_latent", c * r, "full"), Term("attention.kv_normed", c * r, "full"),
              Term("attention.kv_latent_rstd", 4, "full"),
              Term("attention.q_rope", c * qk, "tp"), Term("attention.k_rope", c * qk, "tp", kv=True),
              Term("attention.v", c * qk, "tp", kv=True),    # padded to the q/k width
              Term("attention.lse", 4 * heads, "tp"),
              Term("attention.core_out", c * v, "tp")]
    return terms


def mla_selective_terms(m, precision: str) -> list[Term]:
    """The matmul outputs and the kernel's output and log-sum-exp of one MLA."""
    c = DTYPE_BYTES[precision]
    a, heads, h = m.mla, m.num_heads, m.hidden_size
    out = []
    if a.q_lora_rank is not None:
        out += [Term("attention.wq_a_out", c * a.q_lora_rank, "full")]
    out += [Term("attention.wq_out", c * heads * a.qk_head_dim, "tp"),
            Term("attention.wkv_a_out", c * (a.kv_lora_rank + a.qk_rope_head_dim), "full"),
            Term("attention.wkv_b_out", c * heads * (a.qk_nope_head_dim + a.v_head_dim), "tp"),
            Term("attention.core_out", c * heads * a.v_head_dim, "tp"),
            Term("attention.lse", 4 * heads, "tp"),
            Term("attention.wo_out", c * h, "full")]
    return out


# ------------------------------------------------- Gemma: post-norms, soft-capped scores
def post_norm_terms(terms: list[Term]) -> list[Term]:
    """Gemma 2/3's post-norms (``ModelConfig.post_norms``): an RMSNorm on the
    attention's and on the feed-forward's output before each residual add.
    Each keeps what the block's pre-norm of the same branch keeps (``terms``:
    :func:`layer_terms`' list): its input as the norm receives it (the
    linear's output, in the compute dtype, made fp32 where the norm
    computes in fp32, as the residual stream is for the pre-norms), the
    normalised input for the weight's gradient, one rstd per row. Derived
    from the pre-norms' terms so that the two stay one model of a norm."""
    out = []
    for pre, post in (("attention_norm.", "attention.out_norm."),
                      ("ffn_norm.", "feed_forward.out_norm.")):
        out += [Term(post + t.name.removeprefix(pre), t.bytes_per_token, t.split)
                for t in terms if t.name.startswith(pre)]
    return out


def softcap_math(m, accelerator: bool) -> bool:
    """Whether soft-capped attention scores (``ModelConfig.attn_softcap``,
    Gemma 2) run the math path, scores materialised
    (:func:`giantmodel.models.common.masks.softcap_attention`): off the
    accelerator, or with attention dropout. On a GPU without dropout flex
    attention applies the cap as a score modifier, fused: what it keeps and
    scores is the fused kernel's."""
    return m.attn_softcap is not None and (not accelerator or m.dropout > 0)


def softcap_score_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int,
                        accelerator: bool) -> dict[str, float]:
    """Bytes one block keeps beyond :func:`layer_terms` (which counts the
    fused kernel's q, k, v, output and log-sum-exp) when its soft-capped
    scores run the math path (:func:`softcap_math`; context parallelism is
    refused with soft-capping), one micro-batch, by tensor name. Whatever
    the window, every [s, s] score is computed and kept: the tanh's output
    (compute dtype), the fp32 softmax output, and its cast to the compute
    dtype that the probabilities' matmul reads (in fp32 the cast is the
    softmax output itself): 8 bytes a score in fp32 and in bf16. The masked
    fill keeps the inverted boolean band ([s, s], one per block, broadcast
    over the batch). Under GQA the two matmuls keep k and v repeated to the
    query heads instead of the kernel's k and v (Gemma 2's block: without
    qk-norm, k and v are tensors of their own); no log-sum-exp."""
    if not softcap_math(m, accelerator):
        return {}
    c = DTYPE_BYTES[precision]
    tokens = micro_batch * seq_len
    heads = m.num_heads / tp
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    scores = micro_batch * heads * seq_len * seq_len
    out = {"attention.scores_capped": c * scores,
           "attention.probs_fp32": 4.0 * scores,
           "attention.score_mask": float(seq_len * seq_len),
           "attention.lse_not_kept": -4.0 * tokens * heads}
    if c < 4:
        out["attention.probs"] = c * scores
    if kv != q:
        out["attention.kv_repeated"] = 2.0 * c * tokens * (q - kv) / tp
    return out


# The fused norms (giantmodel.models.common.fused: _RMSNorm, _LayerNorm)
# keep only their input and fp32 statistics, but each forward still writes
# fp32 working tensors, which backward rebuilds: the input made fp32 (a copy
# unless it already is) and the normalised product. Keyed by the saved term
# that holds the norm's input, with the width it normalises.
def _norm_inputs(m, terms: list[Term], c: int) -> list[tuple[str, float, str]]:
    """(norm, width, split) of every fused norm of one block, from its
    terms (``c``: the compute dtype's bytes, in which a norm's input is kept)."""
    out = [(t.name.removesuffix(".input"), t.bytes_per_token / c, t.split) for t in terms
           if t.name.endswith("_norm.input")]
    names = {t.name for t in terms}
    q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    if "attention.qkv_out" in names:   # qk-norm: per head over q and over k
        out += [("attention.q_norm", q, "tp"), ("attention.k_norm", kv, "tp")]
    for latent in ("q_latent", "kv_latent"):   # MLA's latent norms
        if f"attention.{latent}" in names:
            r = m.mla.q_lora_rank if latent == "q_latent" else m.mla.kv_lora_rank
            out.append((f"attention.{latent}_norm", r, "full"))
    return out


def norm_working_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int, sp: bool,
                       cp: int) -> dict[str, float]:
    """Bytes of the fp32 working tensors one block's norms write in forward
    (and rebuild in backward) without keeping them, one micro-batch: per
    norm, its input in fp32 (a copy of a compute-dtype input; none in fp32)
    and the normalised product, each over the normalised width. Not memory
    that a block holds (the memory model leaves them out), but element-wise
    passes the time model must count: until the norms saved only x and
    rstd, these were the tensors they kept, and the time model's
    element-wise term, written as the saved tensors' bytes, lost them with
    that change although every forward still writes them."""
    c = DTYPE_BYTES[precision]
    copies = 2 if c < 4 else 1
    tokens = micro_batch * seq_len / cp
    out = {}
    for norm, width, split in _norm_inputs(m, layer_terms(m, precision), c):
        out[f"{norm}.fp32_work"] = term_bytes(Term(norm, copies * 4.0 * width, split),
                                              tokens, tp, sp, cp)
    return out


def gated_working_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int, sp: bool,
                        cp: int) -> dict[str, float]:
    """Bytes of the gated activation's output ``act(gate)`` one block writes
    without keeping it, one micro-batch, in the compute dtype: the fused
    SwiGLU (``fused._GatedAct``: the dense FFN, an MoE layer's shared
    experts) keeps gate and up, but its forward still writes ``act(gate)``
    before the product reads it, and backward rebuilds it. As for
    :func:`norm_working_bytes`: an element-wise pass the time model counts
    and the memory model does not; while the block kept it (before the
    fused path), it was a saved tensor and timed as one. The routed experts
    keep theirs (``moe.experts.silu``), GPT's GELU output is w2's kept input."""
    if m.arch != "llama":
        return {}
    c = DTYPE_BYTES[precision]
    tokens = micro_batch * seq_len / cp
    if m.moe is None:
        return {"feed_forward.act_work": tokens * c * m.ffn_hidden_size / tp}
    fs = m.moe.shared_width(m.ffn_hidden_size)
    return {"moe.shared.act_work": tokens * c * fs} if fs else {}   # whole on every tp rank


def family_extra_bytes(m, precision: str, micro_batch: int, seq_len: int, tp: int, sp: bool,
                       cp: int, accelerator: bool) -> dict[str, float]:
    """What one block keeps (no recompute, one micro-batch) that
    :func:`layer_terms` does not count yet: Gemma's post-norms and the
    soft-capped math path's scores. The time model adds each name that
    the memory model's block does not already hold, so a memory model that
    counts them (layer_terms calling :func:`post_norm_terms`,
    layer_activation_bytes adding :func:`softcap_score_bytes`) is not
    counted twice."""
    out = {}
    if m.post_norms and m.arch == "llama":
        tokens = micro_batch * seq_len / cp
        out.update({t.name: term_bytes(t, tokens, tp, sp, cp)
                    for t in post_norm_terms(layer_terms(m, precision))})
    if cp == 1:
        out.update(softcap_score_bytes(m, precision, micro_batch, seq_len, tp, accelerator))
    return out
