"""Megatron-LM indexed dataset (.bin + .idx): byte layout, reading, corruption errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from giantmodel.config.data import DataConfig
from giantmodel.config.errors import ConfigError, UserInputError
from giantmodel.data.checks import check_data
from giantmodel.data.indexed import IndexedDataset, IndexedDatasetWriter, read_index_header, token_dtype

DOCS = [[5, 6, 7, 2], [9, 2], [1, 2, 3, 4, 5, 2]]


def _write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


@pytest.mark.timeout(30)
def test_idx_and_bin_byte_layout(tmp_path):
    prefix = tmp_path / "corpus"
    _write(prefix)
    idx = (tmp_path / "corpus.idx").read_bytes()
    # header: 9-byte magic, uint64 version 1, uint8 dtype code (8 = uint16),
    # uint64 sequence count, uint64 document-index count (docs + 1)
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert idx[9:17] == b"\x01" + b"\x00" * 7
    assert idx[17:18] == b"\x08"
    assert idx[18:26] == (3).to_bytes(8, "little")
    assert idx[26:34] == (4).to_bytes(8, "little")
    body = idx[34:]
    assert body[:12] == struct.pack("<3i", 4, 2, 6)           # lengths, int32
    assert body[12:36] == struct.pack("<3q", 0, 8, 12)        # byte pointers, int64
    assert body[36:68] == struct.pack("<4q", 0, 1, 2, 3)      # document indices, int64
    assert len(idx) == 34 + 68
    flat = [t for d in DOCS for t in d]
    assert (tmp_path / "corpus.bin").read_bytes() == struct.pack(f"<{len(flat)}H", *flat)
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.timeout(30)
def test_read_back_and_dtypes(tmp_path):
    _write(tmp_path / "a")
    ds = IndexedDataset(tmp_path / "a")
    assert len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 12
    assert [ds[i].tolist() for i in range(3)] == DOCS
    assert ds.document_token_range(1, 3) == (4, 12)
    assert ds.tokens[4:12].tolist() == DOCS[1] + DOCS[2]
    assert token_dtype(32000) == np.uint16 and token_dtype(128256) == np.int32
    big = [[70000, 100000, 2]]
    _write(tmp_path / "b", big, np.int32)
    assert (tmp_path / "b.idx").read_bytes()[17] == 4  # int32 code
    assert IndexedDataset(tmp_path / "b")[0].tolist() == big[0]


@pytest.mark.timeout(30)
def test_reads_handwritten_multi_sentence_index(tmp_path):
    """A file laid out by hand from the format description, with 2 sentences in document 0."""
    toks = np.array([11, 12, 13, 14, 15, 2], dtype=np.int32)
    (tmp_path / "m.bin").write_bytes(toks.tobytes())
    hdr = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
    body = struct.pack("<3i", 2, 2, 2) + struct.pack("<3q", 0, 8, 16) + struct.pack("<3q", 0, 2, 3)
    (tmp_path / "m.idx").write_bytes(hdr + body)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.num_documents == 2 and len(ds) == 3
    assert ds[1].tolist() == [13, 14]
    assert ds.document_token_range(0, 1) == (0, 4)


@pytest.mark.timeout(30)
def test_truncated_and_corrupt_files_give_clear_errors(tmp_path):
    prefix = tmp_path / "c"
    _write(prefix)
    idx = tmp_path / "c.idx"
    good = idx.read_bytes()
    idx.write_bytes(good[:-5])
    with pytest.raises(UserInputError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "c.idx is truncated" in msg and "giantmodel preprocess" in msg and str(len(good) - 5) in msg
    idx.write_bytes(good[:20])
    with pytest.raises(UserInputError, match="shorter than the 34-byte header"):
        read_index_header(prefix)
    idx.write_bytes(b"XXXXXXXXX" + good[9:])
    with pytest.raises(UserInputError, match="not a Megatron-LM indexed dataset"):
        IndexedDataset(prefix)
    idx.write_bytes(good)
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:10])
    with pytest.raises(UserInputError, match="c.bin is truncated"):
        IndexedDataset(prefix)
    (tmp_path / "c.bin").unlink()
    with pytest.raises(UserInputError, match="does not exist"):
        IndexedDataset(prefix)


@pytest.mark.timeout(30)
def test_config_validation_names_key_and_path(tmp_path):
    cfg = DataConfig(source="indexed", paths=[str(tmp_path / "missing")], tokenizer="x.model")
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert e.value.key == "data.paths" and "missing.idx does not exist" in str(e.value)
    assert "giantmodel preprocess" in str(e.value)
    _write(tmp_path / "ok")
    (tmp_path / "trunc.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    (tmp_path / "trunc.idx").write_bytes((tmp_path / "ok.idx").read_bytes()[:40])
    cfg = DataConfig(source="indexed", paths=[str(tmp_path / "trunc")], tokenizer="x.model")
    with pytest.raises(ConfigError, match="truncated"):
        check_data(cfg)
    cfg = DataConfig(source="indexed", paths=[str(tmp_path / "ok")], tokenizer=str(tmp_path / "t.model"))
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert e.value.key == "data.tokenizer" and "t.model does not exist" in str(e.value)
    for bad, key in ((dict(source="nope"), "data.source"),
                     (dict(source="indexed"), "data.paths"),
                     (dict(source="indexed", paths=[str(tmp_path / "ok")], weights=[1.0, 2.0]), "data.weights"),
                     (dict(valid_fraction=1.5), "data.valid_fraction"),
                     (dict(source="synthetic", synthetic_pattern="zigzag"), "data.synthetic_pattern"),
                     (dict(builtin_vocab_size=10), "data.builtin_vocab_size")):
        with pytest.raises(ConfigError) as e:
            DataConfig(**bad).validate()
        assert e.value.key == key
    DataConfig().validate()  # the empty section (builtin corpus) is valid
