"""Apply a layout to one model chunk: the whole model or a pipeline stage.

``parallelize`` takes the chunk an objective built, still on the meta
device, and applies, in order:

1. the objective's tensor/sequence-parallel plan (``parallel.tp``, ``parallel.sp``),
   then the expert-parallel plan of its MoE layers (``parallel.ep``:
   giantmodel.parallel.expert);
2. its context-parallel attention (``parallel.cp``), then the optional
   accelerations (fp8 linears, apex norms: giantmodel.parallel.accel);
3. activation recomputation (``recompute``) and activation offload
   (``offload.activations``) around each repeated block;
4. ``torch.compile`` of each block (``train.compile``);
5. the data-parallel strategy's wrapping (FSDP2 units for ZeRO-3 / HSDP).

The objective then initialises the weights: every layout starts from the
single-process weights.
"""

from __future__ import annotations

from torch import nn

from giantmodel.config.train import OffloadConfig
from giantmodel.parallel.accel import Accelerations
from giantmodel.parallel.expert import apply_expert_parallel
from giantmodel.parallel.objective import Objective
from giantmodel.parallel.offload import apply_offload
from giantmodel.parallel.recompute import apply_recompute


def parallelize(module: nn.Module, objective: Objective, dims, strategy, *, sp: bool,
                recompute: str, offload: OffloadConfig, compile: bool,
                recompute_layers: list[str] | None = None,
                accel: Accelerations | None = None) -> nn.Module:
    """``recompute_layers``, when given, is one mode per block by global block
    index (block names end in it); it replaces ``recompute``. ``accel``
    swaps in fp8 linears and fused norms (see giantmodel.parallel.accel)."""
    if dims.tp > 1:
        objective.apply_tensor_parallel(module, dims["tp"], sp=sp)
    if dims.ep > 1:
        apply_expert_parallel(module, dims["ep"])
    if dims.cp > 1:
        objective.apply_context_parallel(module, dims["cp"])
    names = objective.blocks(module)
    if accel is not None:  # before recompute wraps the blocks and FSDP shards them
        accel.apply(module, [module.get_submodule(n) for n in names])
    apply_recompute(module, {n: recompute if recompute_layers is None
                             else recompute_layers[int(n.rsplit(".", 1)[-1])] for n in names})
    blocks = [module.get_submodule(n) for n in names]
    if offload.activations:
        apply_offload(module, blocks, offload.prefetch_layers)
    if compile:
        # Per block, in place: identical blocks share one compiled graph, and
        # Module.compile() keeps parameter names (and so checkpoints) unchanged.
        for block in blocks:
            block.compile()
    strategy.wrap(module, blocks, objective.edge_units(module))
    return module
