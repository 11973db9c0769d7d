"""Mixtral (``MixtralForCausalLM``): Mistral with every feed-forward a
softmax top-k MoE of SwiGLU experts, the chosen weights renormalised; no
shared experts, no dense layers, no router bias.

Experts are read per expert (``block_sparse_moe.experts.{e}.w1/w3/w2``, what
transformers 4.x and 5.x's ``save_pretrained`` write) or stacked (5.x's
``mlp.experts.gate_up_proj`` / ``down_proj``) and written per expert; see
:mod:`giantmodel.models.families.experts`.
"""

from __future__ import annotations

from giantmodel.config.errors import UserInputError
from giantmodel.config.model import ModelConfig
from giantmodel.config.moe import MoEConfig
from giantmodel.models.families.base import NameMap
from giantmodel.models.families.experts import ExpertLayout, StackedExperts
from giantmodel.models.families.llama import LAYER, TOP
from giantmodel.models.families.mistral import MistralFamily

# "mlp.gate" (5.x's in-memory name) is read; "block_sparse_moe.gate", listed
# last, is the one written. The dense MLP names stay so that the llama
# layout's attention adapters (LoRA's PEFT export) are recognised.
MIXTRAL_NAMES = NameMap(base="model.", layers="layers", top=TOP,
                        layer={**LAYER, "mlp.gate": "feed_forward.router.gate",
                               "block_sparse_moe.gate": "feed_forward.router.gate"})


class MixtralFamily(StackedExperts, MistralFamily):
    name = "mixtral"
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    names = MIXTRAL_NAMES
    experts = ExpertLayout("block_sparse_moe", "w1", "w3", "w2")

    def config_from_hf(self, hf: dict) -> dict:
        fields = super().config_from_hf(hf)
        if int(hf.get("num_local_experts", 8)) <= 0:
            raise UserInputError("mixtral with num_local_experts=0 is a dense model; "
                                 "convert it as mistral")
        # Aux-loss coefficients are a training choice (model.moe.aux_loss_coeff),
        # not part of the weights: HF's router_aux_loss_coef is not carried over.
        fields["moe"] = MoEConfig(num_experts=int(hf.get("num_local_experts", 8)),
                                  top_k=int(hf.get("num_experts_per_tok", 2)),
                                  router="softmax", norm_topk_prob=True)
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        out = super().config_to_hf(cfg)
        out.update(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                   intermediate_size=cfg.moe.expert_width(cfg.ffn_hidden_size),
                   router_jitter_noise=0.0, output_router_logits=False)
        return out

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        self.refuse(cfg, mla=None, post_norms=False, partial_rotary_factor=1.0)
        self.refuse_rope(cfg, "llama3")
        self.refuse_moe(cfg, router="softmax", norm_topk_prob=True, n_group=1,
                        routed_scaling_factor=1.0, num_shared_experts=0, first_k_dense=0,
                        dense_layers=[], sparse_step=1, bias_update_rate=0.0)


FAMILY = MixtralFamily()
