"""The built-in stdlib corpus: build, cache, lock across processes, atomic rename."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from giantmodel.config.data import DataConfig
from giantmodel.data import builtin
from giantmodel.data.build import build_loaders, build_tokenizer, vocab_size_of
from giantmodel.data.indexed import IndexedDataset

SMALL = dict(vocab_size=400, max_bytes=150_000, valid_every=10, progress=False, workers=1)


@pytest.mark.timeout(60)
def test_builds_once_then_cached(tmp_path):
    c = builtin.ensure_builtin_corpus(tmp_path, **SMALL)
    assert c.root.parent == tmp_path and c.root.name.startswith("stdlib-")
    tr, va = IndexedDataset(c.train_prefix), IndexedDataset(c.valid_prefix)
    assert tr.num_tokens > 30_000 and va.num_tokens > 0
    assert c.meta["train_bytes"] <= 150_000 and c.meta["valid_files"] >= 1
    train, valid = builtin.select_files(builtin.stdlib_files(), 150_000, 10)
    assert not set(train) & set(valid)  # held-out files never train
    assert all(ds.num_documents == n for ds, n in ((tr, len(train)), (va, len(valid))))
    stamp = os.stat(c.train_prefix.with_suffix(".bin")).st_mtime_ns
    again = builtin.ensure_builtin_corpus(tmp_path, **SMALL)
    assert again.root == c.root and os.stat(c.train_prefix.with_suffix(".bin")).st_mtime_ns == stamp
    assert not list(tmp_path.glob(".stdlib-*"))  # no temp dirs left


@pytest.mark.timeout(60)
def test_config_entry_points_on_builtin(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path), builtin_vocab_size=400, builtin_max_bytes=150_000,
                     builtin_valid_every=10, val_batches=2)
    cfg.validate()
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == vocab_size_of(cfg) == 400
    text = (builtin.stdlib_files()[0]).read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text
    tl, vl = build_loaders(cfg, seq_len=64, global_batch_size=4, micro_batch_size=2, dp_rank=0,
                           dp_size=1, seed=0)
    b = next(tl)
    assert b["input_ids"].shape == (2, 64) and int(b["input_ids"].max()) < 400
    assert len(list(vl)) == 2
    # the cached dataset is the training files' text, one document each, EOS-terminated
    corpus = builtin.builtin_from_config(cfg)
    first = IndexedDataset(corpus.train_prefix)[0].tolist()
    train_files, _ = builtin.select_files(builtin.stdlib_files(), 150_000, 10)
    assert first[-1] == tok.eos_id
    assert tok.decode(first[:-1]) == train_files[0].read_text(encoding="utf-8")


def _concurrent_build(cache: str, log: str, q) -> None:
    real = builtin._build

    def counting(*a, **kw):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*a, **kw)

    builtin._build = counting
    try:
        q.put(str(builtin.ensure_builtin_corpus(cache, **SMALL).root))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(f"error: {e!r}")


@pytest.mark.timeout(90)
def test_concurrent_callers_build_once(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    log = tmp_path / "builds.log"
    procs = [ctx.Process(target=_concurrent_build, args=(str(tmp_path / "c"), str(log), q))
             for _ in range(3)]
    for p in procs:
        p.start()
    roots = [q.get(timeout=80) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert len(set(roots)) == 1 and not roots[0].startswith("error"), roots
    assert len(log.read_text().split()) == 1  # the lock let exactly one process build
    assert IndexedDataset(os.path.join(roots[0], "train")).num_tokens > 0


@pytest.mark.timeout(60)
def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    real = builtin._build

    def dies_halfway(tmp, *a, **kw):
        (tmp / "tokenizer.model").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(builtin, "_build", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        builtin.ensure_builtin_corpus(tmp_path, **SMALL)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # neither final nor temp dir
    # a build killed outright (no cleanup) leaves a temp dir; the next build clears it
    key = builtin.corpus_key(400, 150_000, 10, builtin.sysconfig.get_paths()["stdlib"])
    stale = tmp_path / f".stdlib-{key}.tmp99999"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"junk")
    monkeypatch.setattr(builtin, "_build", real)
    c = builtin.ensure_builtin_corpus(tmp_path, **SMALL)
    assert not stale.exists() and (c.root / "meta.json").is_file()
