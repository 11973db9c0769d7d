"""Tokenizers: SentencePiece training/loading/round trip, HF tokenizer.json, error messages."""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import pytest

from giantmodel.config.errors import UserInputError
from giantmodel.data.commands import add_tokenizer_arguments, run_tokenizer
from giantmodel.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    train_sentencepiece,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE = 'def f(x):\n\tif x:\n        return "héllo  wörld" + str(42)\n\n# done ✓\n'


def _lines():
    for name in ("argparse.py", "textwrap.py", "string.py"):
        yield from (STDLIB / name).read_text(encoding="utf-8").split("\n")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(_lines(), tmp_path_factory.mktemp("sp") / "tok", 600, num_threads=1)


@pytest.mark.timeout(60)
def test_sentencepiece_train_load_roundtrip(sp_model):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 600
    assert (tok.eos_id, tok.bos_id) == (2, 1)
    ids = tok.encode(SAMPLE)
    assert all(0 <= i < 600 for i in ids)
    assert tok.eos_id not in ids  # encode never adds specials; preprocess appends EOS
    # exact round trip: newlines, tabs, runs of spaces and non-ASCII (byte fallback) survive
    assert tok.decode(ids) == SAMPLE
    # a directory holding tokenizer.model resolves to it
    d = sp_model.parent / "dir"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert load_tokenizer(d).encode(SAMPLE) == ids


@pytest.mark.timeout(60)
def test_sentencepiece_training_is_deterministic(sp_model, tmp_path):
    again = train_sentencepiece(_lines(), tmp_path / "again", 600, num_threads=1)
    assert again.read_bytes() == sp_model.read_bytes()


@pytest.mark.timeout(60)
def test_tokenizer_train_cli(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text((STDLIB / "textwrap.py").read_text(encoding="utf-8"))
    p = argparse.ArgumentParser()
    add_tokenizer_arguments(p)
    assert run_tokenizer(p.parse_args(["train", "--input", str(src), "--vocab-size", "400",
                                       "--out", str(tmp_path / "cli")])) == 0
    assert load_tokenizer(tmp_path / "cli.model").vocab_size == 400
    with pytest.raises(UserInputError, match="vocab-size"):
        run_tokenizer(p.parse_args(["train", "--input", str(src), "--vocab-size", "50000",
                                    "--out", str(tmp_path / "big")]))
    assert not (tmp_path / "big.model").exists()


def _tiny_hf_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_lines()), trainer=trainer)
    tok.save(str(path))


@pytest.mark.timeout(60)
def test_hf_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    _tiny_hf_tokenizer(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 300
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE and 2 not in ids
    assert load_tokenizer(tmp_path).encode(SAMPLE) == ids  # directory form
    # tokenizer_config.json beside it decides which special token is EOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert load_tokenizer(path).eos_id == 0


@pytest.mark.timeout(30)
def test_missing_or_bad_tokenizer_errors(tmp_path):
    missing = tmp_path / "nope" / "tok.model"
    with pytest.raises(UserInputError) as e:
        load_tokenizer(missing)
    assert str(missing) in str(e.value) and "giantmodel tokenizer train" in str(e.value)
    with pytest.raises(UserInputError, match="no tokenizer.model or tokenizer.json"):
        load_tokenizer(tmp_path)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(UserInputError, match="not a valid SentencePiece model"):
        load_tokenizer(junk)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{}")
    with pytest.raises(UserInputError, match="not a valid tokenizer.json"):
        load_tokenizer(bad_json)
