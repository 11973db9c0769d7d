"""The decoder-only skeleton that GPT and LLaMA share.

Top-level names are fixed (``tok_embeddings``, ``pos_embeddings``, ``layers``,
``norm``, ``output``) and layers sit in a ModuleDict keyed by their global
index, so a pipeline stage that deletes the layers it does not own keeps the
same parameter names: checkpoints then load under any layout.
Any of the top-level modules may be None on a pipeline stage; forward skips it.
"""

from __future__ import annotations

import torch
from torch import nn

from giantmodel.config.model import ModelConfig
from giantmodel.models.common.fused import compute_dtype
from giantmodel.models.common.layers import (
    Attention,
    KVCache,
    SoftcapLinear,
    configure_block,
    rope_table,
)
from giantmodel.models.common.masks import document_mask
from giantmodel.models.common.mla import MLA
from giantmodel.models.common.moe import MoE


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, block_cls: type[nn.Module], norm_cls,
                 learned_positions: bool):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, h)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(cfg.max_seq_len, h) if learned_positions else None)
        self.embed_dropout = nn.Dropout(cfg.dropout) if learned_positions else nn.Identity()
        self.layers = nn.ModuleDict({str(i): block_cls(cfg) for i in range(cfg.num_layers)})
        if cfg.mla is not None:  # the attention choice: latent attention in every block
            for block in self.layers.values():
                block.attention = MLA(cfg)
        for i, block in enumerate(self.layers.values()):
            if isinstance(getattr(block, "attention", None), Attention):
                configure_block(block, cfg, i)
        if cfg.moe is not None:
            # The feed-forward is the one per-layer choice: MoE on the sparse
            # layers (first_k_dense, dense_layers, sparse_step), dense elsewhere.
            for i in cfg.moe.sparse_layers(cfg.num_layers):
                self.layers[str(i)].feed_forward = MoE(h, cfg.ffn_hidden_size, cfg.moe)
        self.norm: nn.Module | None = norm_cls(h, eps=cfg.norm_eps)
        self.output: nn.Module | None = (
            nn.Linear(h, cfg.vocab_size, bias=False) if cfg.final_softcap is None
            else SoftcapLinear(h, cfg.vocab_size, cfg.final_softcap))
        self.uses_rope = not learned_positions
        # RoPE table: a non-persistent buffer, rebuilt by init_buffers() after
        # meta-device construction (it is never part of a checkpoint).
        self.register_buffer("rope", torch.empty(0), persistent=False)
        # Gemma's local layers rotate with their own base; LongRoPE has a
        # second table for sequences past the original context.
        self.register_buffer("rope_local", torch.empty(0), persistent=False)
        self.register_buffer("rope_long", torch.empty(0), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head (when configured and both
        live on this pipeline stage). Moving off the meta device creates new
        Parameters, so this runs again after materialisation."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def keep_stage(self, layers: range, first: bool, last: bool) -> None:
        """Cut this model down, in place, to one pipeline stage: the blocks in
        ``layers``, plus the embeddings on the first stage and the final
        norm and head on the last. Names stay those of the whole model."""
        if not first:
            self.tok_embeddings = None
            self.pos_embeddings = None
            # Embedding dropout belongs to the first stage only; later stages
            # get hidden states that already went through it.
            self.embed_dropout = nn.Identity()
        if not last:
            self.norm = None
            self.output = None
        for i in range(self.cfg.num_layers):
            if i not in layers:
                del self.layers[str(i)]

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        if self.uses_rope:
            c = self.cfg
            self.rope = rope_table(c.rotary_dim, c.max_seq_len, c.rope_theta,
                                   c.rope_scaling, device=device)
            if c.rope_local_theta is not None:
                self.rope_local = rope_table(c.rotary_dim, c.max_seq_len, c.rope_local_theta,
                                             None, device=device)
            if c.rope_scaling is not None and c.rope_scaling.type == "longrope":
                self.rope_long = rope_table(c.rotary_dim, c.max_seq_len, c.rope_theta,
                                            c.rope_scaling, device=device, long=True)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(global, local) RoPE rows of ``positions``; local is None without
        a local base. LongRoPE takes its long factors when the sequence runs
        past the original context (transformers' rule: max position + 1 >
        original_max_seq_len), chosen on the device without a host sync."""
        if not self.uses_rope:
            return None, None
        rope = self.rope[positions]
        if self.rope_long.numel():
            limit = self.cfg.rope_scaling.original_max_seq_len
            rope = torch.where(positions.max() + 1 > limit, self.rope_long[positions], rope)
        local = self.rope_local[positions] if self.rope_local.numel() else None
        return rope, local

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """``tokens`` [B, T] ids (or [B, T, H] hidden states on a later
        pipeline stage) -> logits [B, T, V] (or hidden states).

        ``positions`` [T] or [B, T] gives each token's absolute position when
        the sequence is not 0..T-1 (context-parallel shards, packed examples).
        ``document_ids`` [B, T] marks packed examples: attention then stays
        within each example (block-diagonal causal); None is plain causal.
        ``cache`` (generation): ``tokens`` follow the ``cache.length`` tokens
        already cached, whose keys and values are reused, not recomputed."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.cfg.embed_scale:
                # sqrt(hidden) rounded to the embedding's dtype first, as
                # Gemma's own code does (55.5, not 55.43, in bf16).
                h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype).item()
        else:
            h = tokens
        T = h.shape[1]
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + T, device=h.device)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        # The residual stream runs in the compute dtype (Megatron's
        # default): norms then save bf16 inputs and linears read them
        # without casts. Later pipeline stages receive it so.
        h = self.embed_dropout(h.to(compute_dtype(h)))
        rope, rope_local = self._rope_tables(positions)
        mask = None
        if document_ids is not None:
            # flash varlen has no score modifier: soft-capped attention
            # takes the flex mask on CUDA (the dense one on the CPU)
            kernel = "flex" if self.cfg.attn_softcap and h.is_cuda else "auto"
            mask = document_mask(document_ids, compute_dtype(h), kernel)
        if cache is not None and mask is not None:
            raise ValueError("a KV cache serves one sequence per row, not packed batches")
        for name, layer in self.layers.items():
            # By the layer's global index (its name): under pp a stage's
            # first layer may be any of the pattern's.
            r = rope_local if rope_local is not None and self.cfg.uses_local_rope(int(name)) \
                else rope
            # Keywords only where given: a wrapped block (recompute, compile)
            # keeps the plain call of training.
            if cache is not None:
                h = layer(h, r, cache=cache.layer(name))
            else:
                h = layer(h, r) if mask is None else layer(h, r, mask=mask)
        if cache is not None:
            cache.advance(T)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
