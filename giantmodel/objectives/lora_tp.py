"""Tensor parallelism for LoRA linears, sharded consistently with their base.

For a column-parallel base (``W`` [out, in] split by rows, ``Shard(0)``) each
rank computes its own slice of the output, so ``B`` [out, r] is split the same
way and ``A`` [r, in] is replicated:

    y_i = x W_i^T + s * (x A^T) B_i^T                    (output Shard(-1))

For a row-parallel base (``W`` split by columns, ``Shard(1)``, input
``Shard(-1)``) each rank holds a slice of the input, so ``A`` is split by
columns like ``W`` and ``B`` is replicated; both terms are partial sums and
meet in the base's single all-reduce (or reduce-scatter under sequence
parallelism):

    y = sum_i [ x_i W_i^T + s * (x_i A_i^T) B^T ]         (output Partial)

The adapter weights are DTensors, so DTensor's sharding rules give the
replicated factor's gradient its all-reduce. The styles copy the layouts of the
plain ``ColwiseParallel``/``RowwiseParallel`` they replace, so the rest of
the block's plan is unchanged.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from giantmodel.models.lora import LoRALinear


def _distribute(module: nn.Module, name: str, mesh, placements) -> None:
    p = getattr(module, name)
    if p is None or isinstance(p, DTensor):
        return
    module.register_parameter(name, nn.Parameter(
        distribute_tensor(p, mesh, placements, src_data_rank=None),
        requires_grad=p.requires_grad))


class _LoRAStyle(ParallelStyle):
    base_weight: Shard
    base_bias: Shard | Replicate
    a_weight: Shard | Replicate
    b_weight: Shard | Replicate

    def __init__(self, plain: ColwiseParallel | RowwiseParallel):
        super().__init__()
        self.input_layouts = plain.input_layouts
        self.output_layouts = plain.output_layouts
        self.use_local_output = plain.use_local_output

    def _partition(self, module: nn.Module, mesh) -> None:
        _distribute(module, "weight", mesh, [self.base_weight])
        _distribute(module, "bias", mesh, [self.base_bias])
        _distribute(module.lora_A, "weight", mesh, [self.a_weight])
        _distribute(module.lora_B, "weight", mesh, [self.b_weight])

    def _prepare_input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        if x.placements != self.desired_input_layouts:
            x = x.redistribute(placements=self.desired_input_layouts, async_op=True)
        return (x, *inputs[1:])

    def _prepare_output(self, module, output, mesh):
        if output.placements != self.output_layouts:
            output = output.redistribute(placements=self.output_layouts, async_op=True)
        return output.to_local() if self.use_local_output else output

    def _adapter_hidden(self, h, mesh):
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._partition(module, device_mesh)
        module.lora_B.register_forward_pre_hook(
            lambda m, inputs: (self._adapter_hidden(inputs[0], device_mesh),))
        module.register_forward_pre_hook(
            lambda m, inputs: self._prepare_input(m, inputs, device_mesh))
        module.register_forward_hook(
            lambda m, inputs, out: self._prepare_output(m, out, device_mesh))
        return module


class LoRAColwise(_LoRAStyle):
    """Base ``Shard(0)``, bias ``Shard(0)``, ``A`` replicated, ``B`` ``Shard(0)``."""

    base_weight, base_bias, a_weight, b_weight = Shard(0), Shard(0), Replicate(), Shard(0)
    desired_input_layouts = (Replicate(),)

    def _adapter_hidden(self, h, mesh):
        # Identity forward; backward all-reduces the r-wide gradient that B's
        # row shards produce, so A's gradient is replicated, not partial.
        return DTensor.from_local(h.to_local(), mesh, [Replicate()], run_check=False)


class LoRARowwise(_LoRAStyle):
    """Base ``Shard(1)``, bias replicated, ``A`` ``Shard(1)``, ``B`` replicated."""

    base_weight, base_bias, a_weight, b_weight = Shard(1), Replicate(), Shard(1), Replicate()
    desired_input_layouts = (Shard(-1),)

    def _adapter_hidden(self, h, mesh):
        # x_i A_i^T is a partial sum: all-reduce the small [.., r] activation
        # so B's input, and so B's gradient, is replicated.
        return h.redistribute(placements=[Replicate()])


def lora_style(module: nn.Module, style: ParallelStyle) -> ParallelStyle:
    """The style for ``module`` under a plan entry ``style``: the LoRA
    counterpart when ``module`` is a LoRA linear, else ``style`` itself."""
    if not isinstance(module, LoRALinear):
        return style
    if isinstance(style, ColwiseParallel):
        return LoRAColwise(style)
    if isinstance(style, RowwiseParallel):
        return LoRARowwise(style)
    raise TypeError(f"no LoRA tensor-parallel style for {type(style).__name__}")
