"""Bad input never runs (issue defect 12 and failure modes 11 and 13).

Everything goes through the real ``giantmodel train`` entry point: a bad
config or bad data must end in exit status 2 with one ``error:`` line that
names the key (or file), before any process group exists, and leave
``run.dir`` untouched.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from giantmodel.cli import main
from giantmodel.data.indexed import IndexedDatasetWriter, bin_path, idx_path

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=4096", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4",
         "train.steps=2", "train.sample_tokens=0", "train.eval_every=0", "run.tensorboard=false",
         # the fuzzer checks config validation; a valid config too large for this
         # host is the memory preflight's to refuse (tests/test_preflight.py)
         "train.memory_check=false"]


class _ReachedProcessGroup(Exception):
    """Raised in place of creating the process group: every pre-flight check passed."""


@pytest.fixture
def stop_before_process_group(monkeypatch):
    """Accepted configs stop where the process group would be created."""
    import giantmodel.train.trainer as trainer

    def refuse(*args, **kwargs):
        raise _ReachedProcessGroup

    monkeypatch.setattr(trainer, "init_distributed", refuse)


def _snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("untouched: true\n")
    return run


def _train(args: list[str], capsys) -> tuple[int | str, str]:
    try:
        code = main(["train", *args])
    except _ReachedProcessGroup:
        code = "accepted"
    return code, capsys.readouterr().err.strip()


def _assert_one_error_line(code, err: str, *fragments: str) -> None:
    assert code == 2, (code, err)
    assert err.startswith("error:") and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# ------------------------------------------------------------ defect 12

@pytest.mark.parametrize("overrides,key,switch", [
    (["data.paths=[/nonexistent/x]"], "data.paths", "data.source"),
    (["data.tokenizer=/nonexistent/tok.model"], "data.tokenizer", "data.source"),
    (["data.source=synthetic", "data.builtin_vocab_size=512"], "data.builtin_vocab_size", "data.source"),
    (["comm.chunk_kb=64"], "comm.chunk_kb", "comm.backend"),
    (["comm.backend=gloo", "comm.node_size=2"], "comm.node_size", "comm.backend"),
    (["optim.decay_fraction=0.3"], "optim.decay_fraction", "optim.schedule"),
    (["optim.schedule=constant", "optim.min_lr=0.0"], "optim.min_lr", "optim.schedule"),
    (["offload.prefetch_layers=2"], "offload.prefetch_layers", "offload.activations"),
    (["model.arch=gpt", "model.num_kv_heads=null", "model.rope_theta=500000"], "model.rope_theta",
     "model.arch"),
])
def test_a_setting_the_selected_mode_ignores_is_refused(overrides, key, switch, run_dir, capsys,
                                                         stop_before_process_group):
    before = _snapshot(run_dir)
    code, err = _train([*SMALL, f"run.dir={run_dir}", *overrides], capsys)
    _assert_one_error_line(code, err, key, switch)
    assert _snapshot(run_dir) == before


# ------------------------------------------------------- failure mode 13

def _tokenizer(path: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, models

    words = {"</s>": 0, **{f"t{i}": i for i in range(1, vocab)}}  # </s> ends a document
    tok = Tokenizer(models.WordLevel(words, unk_token="t1"))
    tok.save(str(path))
    return path


def _dataset(prefix: Path, top: int = 100) -> Path:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in range(20):
            w.add_document((np.arange(40) * (d + 1)) % top)
    return prefix


def _break(prefix: Path, how: str) -> str:
    """Damage the dataset; returns the file the error must name."""
    if how == "truncated .bin":
        data = bin_path(prefix).read_bytes()
        bin_path(prefix).write_bytes(data[: len(data) // 2])
        return str(bin_path(prefix))
    if how in ("float dtype code", "unknown dtype code"):
        data = bytearray(idx_path(prefix).read_bytes())
        data[17] = 7 if how == "float dtype code" else 42  # the dtype byte of the header
        idx_path(prefix).write_bytes(bytes(data))
        return str(idx_path(prefix))
    tokens = np.fromfile(bin_path(prefix), dtype=np.uint16)
    tokens[123] = 200  # the tokenizer has 100 ids
    tokens.tofile(bin_path(prefix))
    return str(bin_path(prefix))


@pytest.mark.parametrize("how", ["truncated .bin", "float dtype code", "unknown dtype code",
                                 "token id >= vocabulary"])
def test_bad_data_fails_before_the_first_step(how, tmp_path, run_dir, capsys,
                                              stop_before_process_group):
    prefix = _dataset(tmp_path / "corpus")
    tok = _tokenizer(tmp_path / "tokenizer.json", 100)
    named = _break(prefix, how)
    before = _snapshot(run_dir)
    code, err = _train([*SMALL, f"run.dir={run_dir}", "data.source=indexed",
                        f"data.paths=[{prefix}]", f"data.tokenizer={tok}"], capsys)
    _assert_one_error_line(code, err, named, "data.paths")
    assert _snapshot(run_dir) == before


def test_good_data_passes_the_same_checks(tmp_path, run_dir, capsys, stop_before_process_group):
    prefix = _dataset(tmp_path / "corpus")
    tok = _tokenizer(tmp_path / "tokenizer.json", 100)
    code, err = _train([*SMALL, f"run.dir={run_dir}", "data.source=indexed",
                        f"data.paths=[{prefix}]", f"data.tokenizer={tok}"], capsys)
    assert code == "accepted", err


# ------------------------------------------------------- failure mode 11

def _fields() -> list[tuple[str, object]]:
    """(dotted key, default value) of every scalar config field."""
    import dataclasses

    from giantmodel.config.schema import JobConfig

    out = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif value is None and str(f.type).startswith(("list[", "tuple[")):
                # an optional list (``list[int] | None``): mutate it as a list,
                # for which "[1, 2]" may be valid
                out.append((f"{prefix}{f.name}", []))
            else:
                out.append((f"{prefix}{f.name}", value))
    walk(JobConfig(), "")
    # run.dir is the test's own (given last on every command line): a
    # mutation of it would be overridden, not checked
    return [(k, v) for k, v in out if k != "run.dir"]


# Mutations that are always invalid, and value mutations that may be valid.
INVALID = ("wrong type", "unknown key", "wrong nesting", "missing file", "mapping for scalar")
VALUES = ("negative", "huge", "zero")


def _mutation(rng: random.Random, fields, tmp: Path, i: int) -> tuple[str, list[str], str, str | None]:
    """(kind, extra CLI args, key the error must name, YAML text or None)."""
    kind = rng.choice(INVALID + VALUES)
    key, default = rng.choice(fields)
    if isinstance(default, (list, tuple)) and kind in ("wrong type", *VALUES):
        return "wrong type", [f"{key}={{a: 1}}"], key, None  # a list field: [1] may be valid
    if kind == "wrong type":
        if isinstance(default, bool) or isinstance(default, (int, float)):
            return kind, [f"{key}={rng.choice(['abc', '[1, 2]', '{a: 1}'])}"], key, None
        return kind, [f"{key}={rng.choice(['[1, 2]', '{a: 1}'])}"], key, None
    if kind == "unknown key":
        section = key.rsplit(".", 1)[0] if "." in key else ""
        bogus = f"{section}.{key.rsplit('.', 1)[-1]}{rng.choice(['x', '_s', 'zz'])}".lstrip(".")
        return kind, [f"{bogus}=1"], bogus, None
    if kind == "wrong nesting":
        section = key.split(".")[0]
        if "." not in key:  # a top-level scalar given a section's shape
            return kind, [], key, f"{key}:\n  inner: 1\n"
        leaf = key.rsplit(".", 1)[-1]
        return kind, [], leaf, f"{leaf}: 1\n{section}: {{}}\n"  # a section key at the top level
    if kind == "mapping for scalar":
        if "." not in key:
            return "wrong type", [f"{key}=[1]"], key, None
        section, leaf = key.split(".", 1)
        return kind, [], key, f"{section}:\n  {leaf}:\n    nested: 2\n"
    if kind == "missing file":
        missing = str(tmp / f"missing-{i}")
        which = rng.choice(["data", "init_from", "config"])
        if which == "data":
            return kind, ["data.source=indexed", f"data.paths=[{missing}]",
                          f"data.tokenizer={missing}.model"], missing, None
        if which == "init_from":
            return kind, [f"checkpoint.init_from={missing}"], missing, None
        return kind, ["--config", f"{missing}.yaml"], missing, None
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return "wrong type", [f"{key}=[1]"], key, None
    value = {"negative": -rng.choice([1, 7, 10**6]), "zero": 0,
             "huge": rng.choice([10**15, 2**63, 1e300])}[kind]
    return kind, [f"{key}={value}"], key, None


@pytest.mark.timeout(240)
def test_config_fuzzing_300_mutations(tmp_path, run_dir, capsys, stop_before_process_group):
    """Each mutation of a valid config either fails with exit 2 and one line
    naming the key, or (a value that is in fact valid) passes every check;
    never a traceback, and run.dir is never touched. Mutations that are
    invalid by construction must fail."""
    rng = random.Random(20241123)
    fields = _fields()
    before = _snapshot(run_dir)
    tally: dict[str, int] = {}
    for i in range(300):
        kind, args, key, yaml_text = _mutation(rng, fields, tmp_path, i)
        if yaml_text is not None:
            cfg = tmp_path / f"fuzz-{i}.yaml"
            cfg.write_text(yaml_text)
            args = ["--config", str(cfg), *args]
        try:
            # the mutation comes last so that it overrides SMALL's value of its key
            flags = args[:2] if args[:1] == ["--config"] else []
            small = [x for x in SMALL if x.split("=")[0] != key]  # nor may SMALL undo it
            code, err = _train([*flags, *small, f"run.dir={run_dir}", *args[len(flags):]], capsys)
        except BaseException as e:  # any escape is the failure this test finds
            raise AssertionError(f"mutation {i} ({kind}) {args} {yaml_text!r} raised "
                                 f"{type(e).__name__}: {e}") from e
        label = f"mutation {i} ({kind}) {args} {yaml_text!r}"
        if code == "accepted":
            assert kind in VALUES, f"{label} was accepted"
        else:
            try:
                _assert_one_error_line(code, err, key)
            except AssertionError as e:
                raise AssertionError(f"{label}: {e}") from None
        tally[f"{kind}: {'accepted' if code == 'accepted' else 'refused'}"] = \
            tally.get(f"{kind}: {'accepted' if code == 'accepted' else 'refused'}", 0) + 1
        assert _snapshot(run_dir) == before, label
    print("fuzz tally:", dict(sorted(tally.items())))
    assert sum(v for k, v in tally.items() if k.split(":")[0] in INVALID) > 100
