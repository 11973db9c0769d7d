"""Parameter initialisation at scale: drawn in row chunks on the parameter's
device, each rank drawing only the chunks it keeps rows of, and still equal,
shard for shard, to the full tensor a single process draws."""

from __future__ import annotations

import zlib

import pytest
import torch

from giantmodel.config.model import ModelConfig
from giantmodel.models import registry
from giantmodel.models.registry import build_model, full_init_tensor, init_parameter, init_weights
from giantmodel.testing import run_ranks

NAME = "layers.0.attention.wq.weight"  # drawn from a normal
CFG = ModelConfig()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(registry, "INIT_CHUNK_NUMEL", 40)  # 8 rows of 5: many chunks


def test_one_chunk_parameters_keep_their_unchunked_values():
    """Every parameter of the test models fits one chunk: it has exactly the
    values of the single CPU draw used before chunking."""
    gen = torch.Generator().manual_seed((7 * 1_000_003 + zlib.crc32(NAME.encode())) % 2**63)
    before = torch.empty(256, 256).normal_(0.0, CFG.init_std, generator=gen)
    model = init_weights(build_model(CFG), CFG, seed=7)
    assert torch.equal(dict(model.named_parameters())[NAME], before)


@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_draw_equals_the_full_tensor(small_chunks, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: the chunks drawn by a thread pool
    try:
        full = full_init_tensor(NAME, torch.Size([37, 5]), CFG, seed=3)
        plain = torch.nn.Parameter(torch.empty(37, 5))  # requires grad, like a model's
        init_parameter(plain, NAME, CFG, seed=3)
        half = torch.empty(37, 5, dtype=torch.bfloat16)
        init_parameter(half, NAME, CFG, seed=3)
        strided = torch.empty(5, 37).t()  # not contiguous: drawn aside, then copied
        init_parameter(strided, NAME, CFG, seed=3)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(plain, full) and torch.equal(strided, full)
    assert torch.equal(half, full.bfloat16())
    # Chunks have their own streams: no two chunks repeat each other's rows.
    assert not torch.equal(full[:8], full[8:16])
    assert abs(float(full.std()) - CFG.init_std) < 0.3 * CFG.init_std
    # Another seed, other values; ones and zeros need no draw.
    assert not torch.equal(full, full_init_tensor(NAME, torch.Size([37, 5]), CFG, seed=4))
    ones = torch.empty(6)
    init_parameter(ones, "layers.0.attention_norm.weight", CFG, seed=3)
    assert torch.equal(ones, torch.ones(6))


def test_meta_parameters_are_left_alone():
    p = torch.empty(4, 4, device="meta")
    init_parameter(p, NAME, CFG, seed=0)  # nothing to fill, and no error
    assert p.is_meta


# Placements on a 2 x 2 (dp, tp) mesh, on shapes that do not divide evenly.
CASES = [
    ("rows over both", (37, 5), "S0,S0"),
    ("rows, then columns", (37, 6), "S0,S1"),
    ("columns only", (9, 11), "R,S1"),
    ("strided rows (FSDP over colwise TP)", (40, 5), "SS0,S0"),
    ("replicated", (10, 5), "R,R"),
]


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if code == "R":
        return Replicate()
    if code.startswith("SS"):
        return _StridedShard(int(code[2:]), split_factor=2)
    return Shard(int(code[1:]))


def _sharded_cases(rank: int, world: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    registry.INIT_CHUNK_NUMEL = 40
    drawn: list[int] = []
    draw = registry._draw_into

    def counting(out, name, std, seed, chunk):
        drawn.append(chunk)
        return draw(out, name, std, seed, chunk)

    registry._draw_into = counting
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for label, shape, codes in CASES:
        placements = [_placement(c) for c in codes.split(",")]
        full = full_init_tensor(NAME, torch.Size(shape), CFG, seed=5)
        drawn.clear()
        p = distribute_tensor(torch.zeros(shape), mesh, placements)
        init_parameter(p, NAME, CFG, seed=5)
        want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        out[label] = (torch.equal(p.to_local(), want), sorted(drawn))
    # The real thing: FSDP2 over a colwise tensor-parallel linear (its weight
    # becomes strided rows), each parameter gathered back whole.
    lin = nn.Linear(6, 36)
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    fully_shard(lin, mesh=mesh["dp"])
    init_parameter(lin.weight, NAME, CFG, seed=5)
    init_parameter(lin.bias, "layers.0.attention.wq.bias", CFG, seed=5)
    out["fsdp over tp"] = (
        torch.equal(lin.weight.full_tensor(), full_init_tensor(NAME, lin.weight.shape, CFG, 5))
        and torch.equal(lin.bias.full_tensor(), torch.zeros(36)),
        [type(pl).__name__ for pl in lin.weight.placements])
    return out


def test_every_shard_is_its_slice_of_the_full_draw():
    """On 4 ranks, each placement's local shard equals the single-process
    draw's slice, and a rank holding rows of only some chunks draws only those."""
    results = run_ranks(_sharded_cases, 4, timeout=120)
    for rank, res in enumerate(results):
        for label, (equal, _) in res.items():
            assert equal, f"rank {rank}: {label}"
    # 37 rows in chunks of 8 (5 chunks); dp then tp split rows 0-18 | 19-36
    # and each half again: rank 0 keeps rows 0-9, chunks 0 and 1 only.
    assert results[0]["rows over both"][1] == [0, 1]
    assert results[3]["rows over both"][1] == [3, 4]
    # Sharded by columns only, every rank needs every row chunk.
    assert results[0]["columns only"][1] == [0, 1, 2]  # 9 rows of 11: 3 rows a chunk
    assert any("StridedShard" in p for p in results[0]["fsdp over tp"][1])
