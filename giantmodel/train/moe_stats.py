"""After each optimizer step: the MoE layers' statistics, summed over the
data-parallel ranks, become metrics and move the routing biases.

Each MoE layer adds up, over the step's forwards, how many tokens chose
each expert, the assignments it dropped and its raw auxiliary losses
(:mod:`giantmodel.models.common.moe`). One all-reduce over the ranks that
hold the same layers on different tokens (dp x cp) gives every rank the
step's totals, so every replica moves its bias by the same amount and the
replicas stay identical.
"""

from __future__ import annotations

import torch
from torch import nn

from giantmodel.models.common.moe import (
    STAT_AUX,
    STAT_DROPPED,
    STAT_FORWARDS,
    STAT_SEQ_AUX,
    STAT_Z,
    moe_layers,
    update_expert_bias,
)
from giantmodel.parallel.collectives import all_reduce_sum_

_AUX_SLOTS = {"aux_loss": STAT_AUX, "seq_aux_loss": STAT_SEQ_AUX, "z_loss": STAT_Z}


def sum_expert_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Sum each layer's step statistics ``[layers, E + extras]`` over
    ``group`` (the dp x cp ranks), in place."""
    return all_reduce_sum_(stats, group)


class MoEStepStats:
    """The MoE layers of this rank's model parts (none for a dense model,
    which makes :meth:`finish_step` free)."""

    def __init__(self, parts: list[nn.Module], group):
        self.layers = [m for part in parts for m in moe_layers(part)]
        self.group = group

    def finish_step(self, update: bool) -> dict[str, float]:
        """Reduce the step's statistics, move each bias when ``update`` (the
        step's update was applied) and the config asks for it, reset, and
        return the step's metrics: ``moe_load_max_mean`` (the most unbalanced
        layer's max / mean tokens per expert), ``moe_dropped_tokens``
        (assignments dropped by capacity, all layers) and each auxiliary loss
        that is on (its raw value, mean over layers and forwards). Every rank
        of ``group`` must call it."""
        if not self.layers:
            return {}
        cfg = self.layers[0].cfg
        e = cfg.num_experts
        stats = sum_expert_stats(torch.stack([m.stats for m in self.layers]), self.group)
        loads = stats[:, :e]
        if update and cfg.bias_update_rate > 0:
            for layer, load in zip(self.layers, loads):
                update_expert_bias(layer.router.expert_bias, load, cfg.bias_update_rate)
        for layer in self.layers:
            layer.stats.zero_()
        forwards = stats[:, e + STAT_FORWARDS].clamp_min(1)
        ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)
        values = [ratio.max(), stats[:, e + STAT_DROPPED].sum()]
        names = ["moe_load_max_mean", "moe_dropped_tokens"]
        for name in cfg.aux_coeffs:
            values.append((stats[:, e + _AUX_SLOTS[name]] / forwards).mean())
            names.append(f"moe_{name}")
        out = dict(zip(names, torch.stack(values).tolist()))
        out["moe_dropped_tokens"] = int(out["moe_dropped_tokens"])
        return out

