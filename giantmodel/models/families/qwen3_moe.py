"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 (qk-norm, no biases) with
softmax top-k MoE feed-forwards whose chosen weights are renormalised only
when ``norm_topk_prob`` is set; experts ``moe_intermediate_size`` wide; no
shared experts. A layer is dense (an ``intermediate_size`` SwiGLU) when it
is listed in ``mlp_only_layers`` or when (index + 1) is not a multiple of
``decoder_sparse_step``.

Unlike dense Qwen3, a missing ``head_dim`` means hidden_size / num_heads
(what ``Qwen3MoeAttention`` reads). Experts: see
:mod:`giantmodel.models.families.experts`.
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.models.families.base import NameMap
from giantmodel.models.families.experts import ExpertLayout, StackedExperts
from giantmodel.models.families.llama import LlamaFamily
from giantmodel.models.families.qwen2 import refuse_layer_windows
from giantmodel.models.families.qwen3 import QWEN3_NAMES, Qwen3Family

QWEN3_MOE_NAMES = NameMap(base="model.", layers="layers", top=QWEN3_NAMES.top,
                          layer={**QWEN3_NAMES.layer, "mlp.gate": "feed_forward.router.gate"})


class Qwen3MoeFamily(StackedExperts, Qwen3Family):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    names = QWEN3_MOE_NAMES
    experts = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj")

    def config_from_hf(self, hf: dict) -> dict:
        refuse_layer_windows(self.name, hf)
        # transformers 5 writes num_local_experts; released configs say num_experts.
        num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
        if num_experts <= 0:
            raise UserInputError("qwen3_moe with num_experts=0 is a dense model; "
                                 "convert it as qwen3")
        fields = LlamaFamily.config_from_hf(self, hf)  # not Qwen3's head_dim default
        fields["qk_norm"] = True
        fields["moe"] = MoEConfig(
            num_experts=num_experts,
            top_k=int(hf.get("num_experts_per_tok", 8)), router="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            expert_ffn_hidden_size=int(hf.get("moe_intermediate_size", 768)),
            dense_layers=sorted(int(i) for i in hf.get("mlp_only_layers") or []),
            sparse_step=int(hf.get("decoder_sparse_step", 1)))
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        out = super().config_to_hf(cfg)
        m = cfg.moe
        # first_k_dense has no key of its own: those layers join mlp_only_layers.
        dense = sorted(set(m.dense_layers) | set(range(m.first_k_dense)))
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   norm_topk_prob=m.norm_topk_prob,
                   moe_intermediate_size=m.expert_width(cfg.ffn_hidden_size),
                   decoder_sparse_step=m.sparse_step, mlp_only_layers=dense,
                   output_router_logits=False)
        return out

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        self.refuse(cfg, mla=None, post_norms=False, partial_rotary_factor=1.0)
        self.refuse_rope(cfg, "llama3")
        self.refuse_moe(cfg, router="softmax", n_group=1, routed_scaling_factor=1.0,
                        num_shared_experts=0, bias_update_rate=0.0)


FAMILY = Qwen3MoeFamily()
