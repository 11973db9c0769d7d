"""After each optimizer step: the MoE layers' statistics, summed over the
data-parallel ranks, become metrics and move the routing biases.

Each MoE layer adds up, over the step's forwards, how many tokens chose
each expert, the assignments it dropped and its raw auxiliary losses
(:mod:`giantmodel.models.common.moe`). One all-reduce over the ranks that
hold the same layers on different tokens (dp x cp) gives every rank the
step's totals, so every replica moves its bias by the same amount and the
replicas stay identical. Under pipeline parallelism each stage holds some
of the layers: one more small all-reduce over the pipeline ranks combines
the stages' metrics, so rank 0 (which logs) reports every layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
from giantmodel.parallel.collectives import all_reduce_sum_, group_size, sum_scalar

_AUX_SLOTS = {"aux_loss": STAT_AUX, "seq_aux_loss": STAT_SEQ_AUX, "z_loss": STAT_Z}


def sum_expert_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Sum each layer's step statistics ``[layers, E + extras]`` over
    ``group`` (the dp x cp ranks), in place."""
    return all_reduce_sum_(stats, group)


class MoEStepStats:
    """The MoE layers of this rank's model parts (none for a dense model,
    which makes :meth:`finish_step` free). ``pp_group``: the pipeline ranks
    whose stages together hold the model's layers (None without pp)."""

    def __init__(self, parts: list[nn.Module], group, pp_group=None):
        self.layers = [m for part in parts for m in moe_layers(part)]
        self.group = group
        self.pp_group = pp_group if group_size(pp_group) > 1 else None
        self.device = next((p.device for part in parts for p in part.parameters()),
                           torch.device("cpu"))
        self.active = bool(self.layers)
        if self.pp_group is not None:
            # a stage of dense layers only still joins its MoE peers' reduction
            self.active = sum_scalar(len(self.layers), self.pp_group, self.device) > 0

    def finish_step(self, update: bool) -> dict[str, float]:
        """Reduce the step's statistics, move each bias when ``update`` (the
        step's update was applied) and the config asks for it, reset, and
        return the step's metrics: ``moe_load_max_mean`` (the most unbalanced
        layer's max / mean tokens per expert), ``moe_dropped_tokens``
        (assignments dropped by capacity, all layers) and each auxiliary loss
        that is on (its raw value, mean over layers and forwards). Every rank
        of ``group`` and ``pp_group`` must call it."""
        if not self.active:
            return {}
        local = self._reduce_and_update(update) if self.layers else None
        return self._metrics(local)

    def _reduce_and_update(self, update: bool) -> torch.Tensor:
        """This stage's layers -> [max/mean ratio, dropped, layers, then per
        auxiliary loss: the sum over layers of its mean over forwards, and
        whether it is on]."""
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
        out = torch.zeros(3 + 2 * len(_AUX_SLOTS), device=stats.device)
        out[0], out[1], out[2] = ratio.max(), stats[:, e + STAT_DROPPED].sum(), len(self.layers)
        for i, (name, slot) in enumerate(_AUX_SLOTS.items()):
            if name in cfg.aux_coeffs:
                out[3 + 2 * i] = (stats[:, e + slot] / forwards).sum()
                out[4 + 2 * i] = 1
        return out

    def _metrics(self, local: torch.Tensor | None) -> dict[str, float]:
        """Combine the stages' [ratio, dropped, layers, aux...] (one SUM
        all-reduce: each pipeline rank's ratio in its own slot, for the max)."""
        width = 3 + 2 * len(_AUX_SLOTS)
        if self.pp_group is None:
            ratios, rest = local[:1], local[1:]
        else:
            n, rank = group_size(self.pp_group), dist.get_rank(self.pp_group)
            vec = torch.zeros(n + width - 1, device=self.device)
            if local is not None:
                vec[rank] = local[0]
                vec[n:] = local[1:].to(vec.device)
            all_reduce_sum_(vec, self.pp_group)
            ratios, rest = vec[:n], vec[n:]
        values = [ratios.max(), rest[0]]
        names = ["moe_load_max_mean", "moe_dropped_tokens"]
        layers = rest[1].clamp_min(1)
        for i, name in enumerate(_AUX_SLOTS):
            if rest[3 + 2 * i] > 0:
                values.append(rest[2 + 2 * i] / layers)
                names.append(f"moe_{name}")
        out = dict(zip(names, torch.stack(values).tolist()))
        out["moe_dropped_tokens"] = int(out["moe_dropped_tokens"])
        return out
