"""Expert parallelism (``parallel.ep``) against one process.

Every case trains the tiny MoE model of ``layout_harness.TINY["moe"]`` (8
experts, top-2 sigmoid routing, a shared expert, a dense first layer, the
three balance losses and bias updates on, dropless) in fp32 for a few steps;
losses, gradient norms and final parameters must equal the single-process
run within 1e-5. The fast set runs one 2-rank and one 4-rank group; the
full matrix is in the slow set.
"""

from __future__ import annotations

import layout_harness as H
import pytest
import torch

from giantmodel.testing import run_ranks

STEPS = 3
# Every case has the balance losses on: under pp each stage back-propagates
# its own (MoE's AuxLossScaler); under cp each layer sums their statistics
# over the cp ranks (MoE.reduce_stats), so they cover whole sequences.

FAST_2 = [
    ["parallel.ep=2"],
    ["parallel.ep=2", "parallel.zero=1"],
    ["parallel.ep=2", "parallel.cp=2", "parallel.dp=1"],
]
FAST_4 = [
    ["parallel.ep=2", "parallel.dp=4", "parallel.zero=3"],
    ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1"],
    ["parallel.ep=4"],
    ["parallel.ep=2", "parallel.pp=2", "parallel.dp=2"],
]
SLOW_2 = [
    ["parallel.ep=2", "parallel.zero=2"],
    ["parallel.ep=2", "parallel.zero=3"],
    # MoE blocks under tp without ep: the layer runs whole on every tp rank
    ["parallel.tp=2"],
    ["parallel.tp=2", "parallel.sp=true"],
]
SLOW_4 = [
    ["parallel.ep=2", "parallel.dp=4"],
    ["parallel.ep=2", "parallel.dp=4", "parallel.zero=1"],
    ["parallel.ep=2", "parallel.dp=4", "parallel.zero=2"],
    ["parallel.ep=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1"],
    ["parallel.ep=2", "parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=gpipe",
     "recompute=full"],
    # zero-bubble splits backward in two passes over the same graph
    ["parallel.ep=2", "parallel.pp=2", "parallel.dp=2", "parallel.pp_virtual=2",
     "parallel.pp_schedule=zbv"],
    ["parallel.ep=4", "parallel.zero=1"],
    ["parallel.ep=2", "parallel.tp=2"],
    ["parallel.ep=2", "parallel.tp=2", "parallel.zero=3"],
]
# cp: each MoE layer sums its balance-loss statistics over the cp ranks
CP_4 = [
    ["parallel.ep=2", "parallel.dp=2", "parallel.cp=2", "parallel.zero=1"],
    # pipeline stages (AuxLossScaler weights by each rank's units) and
    # whole blocks re-run in backward (the all-reduce re-runs there too)
    ["parallel.ep=2", "parallel.cp=2", "parallel.pp=2", "parallel.dp=1", "recompute=full"],
    # no ep, selective recompute (the all-reduce is recomputed, not kept)
    ["parallel.cp=2", "parallel.dp=2", "recompute=selective"],
    # tp x cp: under sp each tp rank's MoE layer sees its cp slice gathered
    ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.cp=2"],
]


def _all_to_all_rows(rank: int, world: int) -> None:
    """Uneven splits (some empty) through gloo and the giant backend, with
    the backward exchange: sum(out**2) gives each sent row 2 x itself back."""
    import torch.distributed as dist

    from giantmodel.comm import register_backend
    from giantmodel.parallel.collectives import all_to_all_counts, all_to_all_rows

    register_backend()
    groups = [dist.group.WORLD, dist.new_group(backend="giant")]
    sends = torch.tensor([[(3 * src + 2 * dst + 1) % 5 for dst in range(world)]
                          for src in range(world)])                  # rows src -> dst
    for group in groups:
        x = (torch.arange(int(sends[rank].sum()) * 3, dtype=torch.float32).view(-1, 3)
             + 100 * rank).requires_grad_()
        assert torch.equal(all_to_all_counts(sends[rank].view(world, 1), group).view(-1),
                           sends[:, rank])
        out = all_to_all_rows(x, sends[:, rank].tolist(), sends[rank].tolist(), group)
        expected = []
        for src in range(world):
            rows = torch.arange(int(sends[src].sum()) * 3, dtype=torch.float32).view(-1, 3)
            start = int(sends[src, :rank].sum())
            expected.append(rows[start:start + int(sends[src, rank])] + 100 * src)
        assert torch.equal(out, torch.cat(expected)), (rank, group)
        out.square().sum().backward()
        assert torch.equal(x.grad, 2 * x.detach()), (rank, group)


def _expert_shards(rank: int, world: int) -> None:
    """ep=2 really splits the experts: this rank holds 4 of 8, computed
    through the dispatching forward."""
    from giantmodel.distributed.parallel_dims import ParallelDims
    from giantmodel.parallel.expert import expert_modules, is_expert_parameter

    cfg = H.make_config("moe", ["parallel.ep=2"])
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    engine = H.build_engine(cfg, dims)
    experts = expert_modules(engine.parts[0])
    assert len(experts) == 3
    for module in experts:
        assert type(module).__name__.startswith("ExpertParallel")
        assert module.w1.to_local().shape == (4, 64, 32) and module.w1.shape == (8, 64, 32)
        assert is_expert_parameter(module.w2)
    assert not any(is_expert_parameter(p) for p in engine.parts[0].layers["1"].attention.parameters())
    dims.destroy_mesh()


def _two_ranks(rank: int, world: int, cases: list, steps: int) -> list:
    _all_to_all_rows(rank, world)
    _expert_shards(rank, world)
    return H.run_cases(rank, world, cases, steps)


def _check(world: int, cases: list[list[str]], timeout: float) -> None:
    fn = _two_ranks if world == 2 else H.run_cases
    results = run_ranks(fn, world, [("moe", c) for c in cases], STEPS, timeout=timeout)
    for overrides, result in zip(cases, results[0], strict=True):
        H.assert_matches(result, H.reference("moe", overrides, STEPS), label=" ".join(overrides))


@pytest.mark.timeout(200)
def test_ep_on_two_ranks_matches_one_process():
    _check(2, FAST_2, 180)


@pytest.mark.timeout(200)
def test_ep_on_four_ranks_matches_one_process():
    _check(4, FAST_4, 180)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep_layout_matrix_two_ranks():
    _check(2, SLOW_2, 380)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep_layout_matrix_four_ranks():
    _check(4, SLOW_4, 580)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp_layout_matrix_four_ranks():
    _check(4, CP_4, 280)


def test_reference_moves_experts():
    """The comparison is not vacuous: the experts and the routing bias moved."""
    ref = H.reference("moe", [], STEPS)
    name = next(n for n in ref["params"] if n.endswith("experts.w1"))
    assert float((ref["params"][name] - ref["init"][name]).abs().max()) > 1e-4
    assert ref["losses"][0] != ref["losses"][-1]
    assert torch.isfinite(torch.tensor(ref["losses"])).all()


@pytest.mark.parametrize("world, overrides, needle", [
    (3, ["parallel.ep=3"], "does not divide model.moe.num_experts"),
    (2, ["parallel.ep=4"], "does not divide the dp x cp"),
    (2, ["parallel.ep=2", "model.moe=null"], "model.moe is not set"),
    (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero=3"], "ZeRO 0 or 1"),
])
def test_bad_ep_fails_in_one_line_before_any_group(world, overrides, needle):
    from giantmodel.config import ConfigError
    from giantmodel.distributed.parallel_dims import ParallelDims

    cfg = H.make_config("moe", overrides)
    with pytest.raises(ConfigError, match=needle) as err:
        ParallelDims.from_config(cfg, world)
    assert "parallel." in str(err.value) and "\n" not in str(err.value)
