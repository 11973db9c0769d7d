"""Packing, blending, split, determinism, data-parallel sharding and resumption of the loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError
from giantmodel.data.build import build_loaders, build_samples, vocab_size_of
from giantmodel.data.indexed import IndexedDatasetWriter
from giantmodel.data.loader import TrainLoader
from giantmodel.data.samples import BlendedSamples, PackedTokens, SyntheticSamples

EOS = 1


def _corpus(prefix, n_docs, base, seed):
    """Documents of ids in [base, base+100) each ending with EOS; returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(base, base + 100, rng.integers(3, 40)), EOS) for _ in range(n_docs)]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return docs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    a = _corpus(d / "a", 300, 1000, 0)
    b = _corpus(d / "b", 300, 2000, 1)
    tok = d / "tok.model"  # validate() only checks that it exists
    tok.write_bytes(b"")
    return d, a, b


def _cfg(d, **kw):
    base = dict(source="indexed", paths=[str(d / "a")], tokenizer=str(d / "tok.model"),
                valid_fraction=0.1)
    base.update(kw)
    cfg = DataConfig(**base)
    cfg.validate()
    return cfg


def _loader(samples, G, B, r, dp, seed=0):
    return TrainLoader(samples, global_batch_size=G, micro_batch_size=B, dp_rank=r, dp_size=dp,
                       seed=seed)


@pytest.mark.timeout(30)
def test_packing_windows_shift_and_eos(corpora):
    d, a, _ = corpora
    cfg = _cfg(d)
    train, valid = build_samples(cfg, seq_len=16, seed=0)
    stream = np.concatenate(a[:270])  # 10% of 300 documents are held out
    src = train.sources[0]
    assert len(src) == (len(stream) - 1) // 16
    for i in (0, 1, len(src) - 1):
        assert src.get(i).tolist() == stream[i * 16:i * 16 + 17].tolist()
    assert np.concatenate([src.get(i)[:-1] for i in range(len(src))]).tolist() == \
        stream[:len(src) * 16].tolist()  # every token appears exactly once as an input
    tl, _ = build_loaders(cfg, seq_len=16, global_batch_size=4, micro_batch_size=2,
                          dp_rank=0, dp_size=1, seed=0)
    batch = next(tl)
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert (batch["input_ids"] == EOS).any()  # documents are separated by EOS inside windows
    # validation holds exactly the last 30 documents
    assert valid.sources[0].tokens.tolist() == np.concatenate(a[270:]).tolist()


@pytest.mark.timeout(30)
def test_blend_weights_and_wrapping(corpora):
    d, _, _ = corpora
    cfg = _cfg(d, paths=[str(d / "a"), str(d / "b")], weights=[3.0, 1.0])
    train, _ = build_samples(cfg, seq_len=8, seed=0)
    n = 4 * len(train)  # several periods: the smaller-weighted source wraps several times
    rows = train.get_batch(0, n)
    first_id = np.where(rows[:, 0] == EOS, rows[:, 1], rows[:, 0])
    from_a = first_id < 2000
    assert abs(from_a.mean() - 0.75) < 0.01
    assert abs(from_a[:200].mean() - 0.75) < 0.02  # even in a short prefix
    # each source visits all of its samples once per pass over it
    src_a = train.sources[0]
    seen = {train.locate(g)[1] for g in range(n) if train.locate(g)[0] == 0}
    assert seen == set(range(len(src_a)))


@pytest.mark.timeout(30)
def test_determinism_and_seed(corpora):
    d, _, _ = corpora
    cfg = _cfg(d, paths=[str(d / "a"), str(d / "b")])
    def first(seed):
        tl, vl = build_loaders(cfg, seq_len=8, global_batch_size=8, micro_batch_size=4,
                               dp_rank=0, dp_size=1, seed=seed)
        return [next(tl)["input_ids"] for _ in range(5)], [b["input_ids"] for b in vl]
    t0, v0 = first(0)
    t1, v1 = first(0)
    t2, v2 = first(1)
    assert all(torch.equal(x, y) for x, y in zip(t0, t1))
    assert not all(torch.equal(x, y) for x, y in zip(t0, t2))
    assert all(torch.equal(x, y) for x, y in zip(v0, v1))


def _step_micro(samples, G, B, dp, steps):
    """All ranks' micro-batches per step, concatenated in rank order."""
    loaders = [_loader(samples, G, B, r, dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [[next(ld)["input_ids"] for _ in range(G // (B * dp))] for ld in loaders]
        out.append(torch.cat([x for rank in per_rank for x in rank]))
    return out, loaders


@pytest.mark.timeout(30)
def test_dp_shards_union_equals_single_process():
    samples = BlendedSamples([SyntheticSamples(1000, 8, 97, seed=3, pattern="random")], None, seed=3)
    ref, _ = _step_micro(samples, 8, 8, 1, 30)  # crosses several epochs of 97 samples
    for B, dp in ((1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (1, 8)):
        got, _ = _step_micro(samples, 8, B, dp, 30)
        assert all(torch.equal(x, y) for x, y in zip(ref, got)), (B, dp)
    # rank r of dp=2 holds the contiguous half r of each step
    ld = _loader(samples, 8, 2, 1, 2)
    assert list(ld.next_indices()) == [4, 5]


@pytest.mark.timeout(30)
def test_resume_exactly_next_batches_under_new_layout():
    samples = BlendedSamples([SyntheticSamples(1000, 8, 50, seed=0, pattern="random")], None, seed=0)
    ref, _ = _step_micro(samples, 8, 2, 1, 12)
    _, loaders = _step_micro(samples, 8, 2, 2, 5)  # 5 steps on dp=2, micro 2
    states = [ld.state_dict() for ld in loaders]
    assert states[0] == states[1] and states[0]["consumed_samples"] == 40
    for B, dp in ((2, 2), (1, 4), (4, 1), (8, 1)):
        resumed = [_loader(samples, 8, B, r, dp) for r in range(dp)]
        for ld in resumed:
            ld.load_state_dict(states[0])
        for step in range(5, 12):
            per_rank = [[next(ld)["input_ids"] for _ in range(8 // (B * dp))] for ld in resumed]
            assert torch.equal(torch.cat([x for rk in per_rank for x in rk]), ref[step]), (B, dp)
    # a new global batch size continues from the same sample
    ld = _loader(samples, 4, 4, 0, 1)
    ld.load_state_dict(states[0])
    assert list(ld.next_indices()) == [40, 41, 42, 43]


@pytest.mark.timeout(30)
def test_resume_mid_step_and_mismatch_errors():
    samples = BlendedSamples([SyntheticSamples(100, 8, 50, seed=0)], None, seed=0)
    a = _loader(samples, 8, 2, 1, 2)
    next(a)
    st = a.state_dict()
    assert st["micro_in_step"] == 1 and st["consumed_samples"] == 4
    b = _loader(samples, 8, 2, 1, 2)
    b.load_state_dict(st)
    assert torch.equal(next(b)["input_ids"], next(a)["input_ids"])
    with pytest.raises(ConfigError, match="middle of an optimizer step"):
        _loader(samples, 8, 1, 0, 2).load_state_dict(st)
    with pytest.raises(ConfigError, match="seed=0") as e:
        _loader(samples, 8, 2, 0, 2, seed=5).load_state_dict(st)
    assert e.value.key == "train.seed"
    with pytest.raises(ConfigError, match="not divisible"):
        _loader(samples, 8, 3, 0, 2)


@pytest.mark.timeout(30)
def test_validation_sharded_reiterable(corpora):
    d, _, _ = corpora
    cfg = _cfg(d, paths=[str(d / "a")], valid_paths=[str(d / "b")], val_batches=5)
    ranks = [build_loaders(cfg, seq_len=8, global_batch_size=8, micro_batch_size=2, dp_rank=r,
                           dp_size=2, seed=0)[1] for r in range(2)]
    single = build_loaders(cfg, seq_len=8, global_batch_size=8, micro_batch_size=4, dp_rank=0,
                           dp_size=1, seed=0)[1]
    assert len(ranks[0]) == 5 and ranks[0].num_samples == len(single.samples)
    first = [b["input_ids"] for b in ranks[0]]
    assert all(torch.equal(x, y["input_ids"]) for x, y in zip(first, ranks[0]))  # re-iterable
    for j, (b0, b1, s) in enumerate(zip(ranks[0], ranks[1], single)):
        assert torch.equal(torch.cat([b0["input_ids"], b1["input_ids"]]), s["input_ids"]), j
    # explicit validation data comes from b only (ids >= 2000 or EOS)
    ids = torch.cat(first)
    assert bool(((ids >= 2000) | (ids == EOS)).all())
    assert len(list(ranks[0].batches(2))) == 2


@pytest.mark.timeout(30)
def test_synthetic_source():
    cfg = DataConfig(source="synthetic", synthetic_num_samples=1000)
    cfg.validate()
    assert vocab_size_of(cfg) is None
    with pytest.raises(ConfigError, match="synthetic_vocab_size"):
        build_loaders(cfg, seq_len=16, global_batch_size=4, micro_batch_size=4, dp_rank=0,
                      dp_size=1, seed=0)
    tl, vl = build_loaders(cfg, seq_len=16, global_batch_size=4, micro_batch_size=4, dp_rank=0,
                           dp_size=1, seed=0, vocab_size=64)
    x = next(tl)["input_ids"]
    step = (x[:, 1] - x[:, 0]) % 64
    assert torch.equal((x[:, :1] + step[:, None] * torch.arange(16)) % 64, x)  # arithmetic rows
    assert int(x.max()) < 64 and len(list(vl)) == cfg.val_batches
    rnd = SyntheticSamples(50, 16, 10, seed=1, pattern="random")
    assert rnd.get(3).tolist() == SyntheticSamples(50, 16, 10, seed=1, pattern="random").get(3).tolist()
    assert rnd.get(3).tolist() != SyntheticSamples(50, 16, 10, seed=2, pattern="random").get(3).tolist()


@pytest.mark.timeout(30)
def test_too_little_data_is_a_config_error(tmp_path):
    with IndexedDatasetWriter(tmp_path / "tiny", np.uint16) as w:
        w.add_document([5, 6, EOS])
    (tmp_path / "t.model").write_bytes(b"")
    cfg = DataConfig(source="indexed", paths=[str(tmp_path / "tiny")], tokenizer=str(tmp_path / "t.model"))
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        build_loaders(cfg, seq_len=16, global_batch_size=1, micro_batch_size=1, dp_rank=0,
                      dp_size=1, seed=0)
    assert len(PackedTokens(np.arange(17), 16)) == 1 and len(PackedTokens(np.arange(16), 16)) == 0
