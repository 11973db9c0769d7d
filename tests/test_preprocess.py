"""`giantmodel preprocess`: every input format, worker processes, EOS, progress, errors."""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import pytest

from giantmodel.config.errors import UserInputError
from giantmodel.data.commands import add_preprocess_arguments, run_preprocess
from giantmodel.data.indexed import IndexedDataset
from giantmodel.data.preprocess import preprocess
from giantmodel.data.tokenizer import load_tokenizer, train_sentencepiece

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    lines = (STDLIB / "argparse.py").read_text(encoding="utf-8").split("\n")
    return train_sentencepiece(lines, tmp_path_factory.mktemp("tok") / "sp", 500, num_threads=1)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    # real, varied documents: the functions and classes of a stdlib module, 100+ of them
    text = (STDLIB / "textwrap.py").read_text(encoding="utf-8") + \
        (STDLIB / "shlex.py").read_text(encoding="utf-8")
    parts = [p for p in text.split("\n\n") if p.strip()]
    return [p.strip("\n") for p in parts] * 3


def _expected(tok_path, texts):
    tok = load_tokenizer(tok_path)
    return [tok.encode(t) + [tok.eos_id] for t in texts]


def _read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.timeout(90)
def test_all_formats_with_two_workers(tmp_path, tok_path, docs, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr("giantmodel.data.preprocess._CHUNK_BYTES", 2000)  # many chunks in flight
    want = _expected(tok_path, docs)
    jl = tmp_path / "in.jsonl"
    jl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    txt = tmp_path / "in.txt"
    txt.write_text("\n\n".join(docs) + "\n")
    pqf = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": docs}), pqf, row_group_size=37)
    hfd = tmp_path / "hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(str(hfd))
    for src, key in ((jl, "body"), (txt, "text"), (pqf, "body"), (hfd, "body")):
        out = tmp_path / f"out_{src.name}"
        st = preprocess([str(src)], out, tok_path, json_key=key, workers=2, progress=False)
        assert st.documents == len(docs), src
        assert _read(out) == want, src
        assert st.tokens == sum(map(len, want))
    # the worker count never changes the bytes written
    preprocess([str(jl)], tmp_path / "one", tok_path, json_key="body", workers=1, progress=False)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "out_in.jsonl.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "out_in.jsonl.idx").read_bytes()


@pytest.mark.timeout(60)
def test_cli_progress_skips_and_text_units(tmp_path, tok_path, capsys):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "alpha beta"}\nnot json\n{"other": 1}\n{"text": "gamma"}\n')
    p = argparse.ArgumentParser()
    add_preprocess_arguments(p)
    args = p.parse_args(["--input", str(jl), "--output-prefix", str(tmp_path / "o"),
                         "--tokenizer", str(tok_path), "--workers", "2"])
    assert run_preprocess(args) == 0
    cap = capsys.readouterr()
    assert "tokens/s" in cap.err and "skipped 2 records" in cap.out
    assert _read(tmp_path / "o") == _expected(tok_path, ["alpha beta", "gamma"])
    txt = tmp_path / "t.txt"
    txt.write_text("a b\nc\n\nd\n")
    for unit, texts in (("line", ["a b", "c", "d"]), ("paragraph", ["a b\nc", "d"]),
                        ("file", ["a b\nc\n\nd\n"])):
        preprocess([str(txt)], tmp_path / unit, tok_path, text_unit=unit, progress=False)
        assert _read(tmp_path / unit) == _expected(tok_path, texts), unit


@pytest.mark.timeout(30)
def test_bad_inputs_fail_before_writing(tmp_path, tok_path):
    out = tmp_path / "out"
    with pytest.raises(UserInputError, match="does not exist"):
        preprocess([str(tmp_path / "missing.jsonl")], out, tok_path, progress=False)
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "x"}\n')
    with pytest.raises(UserInputError) as e:
        preprocess([str(jl)], out, tmp_path / "no_tok.model", progress=False)
    assert "no_tok.model does not exist" in str(e.value)
    with pytest.raises(UserInputError, match="no documents found"):
        preprocess([str(jl)], out, tok_path, json_key="body", progress=False)
    assert not list(tmp_path.glob("out*"))  # nothing half-written is left behind


@pytest.mark.timeout(60)
def test_hf_tokenizer_json_with_workers(tmp_path, docs):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:50]))
    st = preprocess([str(jl)], tmp_path / "o", tmp_path, workers=2, progress=False)
    assert st.documents == 50
    got = _read(tmp_path / "o")
    assert got == _expected(tmp_path / "tokenizer.json", docs[:50])
    assert all(d[-1] == 1 for d in got)  # <|endoftext|> is the EOS
