"""The command line: every subcommand's --help, one-line errors for bad input, train+generate."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from giantmodel.cli import main

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["train", "preprocess", "tokenizer", "generate", "convert", "version",
               "estimate", "plan", "bench"]
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=64",
         "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4",
         "run.tensorboard=false"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: giantmodel" in capsys.readouterr().out


def _snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def existing_run(tmp_path):
    """A run directory with content that bad input must leave untouched."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000005").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-00000005\n")
    (run / "config.yaml").write_text("good: true\n")
    return run


def _truncated_idx(tmp_path) -> str:
    from giantmodel.data.indexed import IndexedDatasetWriter, idx_path

    prefix = tmp_path / "corpus"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(20):
            w.add_document(np.arange(10 + i) % 100)
    data = idx_path(prefix).read_bytes()
    idx_path(prefix).write_bytes(data[: len(data) // 2])
    return str(prefix)


BAD = {
    "unknown key": (["model.hiden_size=64"], "did you mean 'model.hidden_size'"),
    "wrong type": (["train.steps=many"], "train.steps"),
    "missing data path": (["data.source=indexed", "data.paths=[/nonexistent/corpus]",
                           "data.tokenizer=/nonexistent/tok.model"], "/nonexistent/corpus"),
    "seq_len > max_seq_len": (["train.seq_len=128"], "model.max_seq_len"),
    "heads not divisible by kv heads": (["model.num_kv_heads=3"], "num_kv_heads"),
    "missing tokenizer": (["data.source=indexed", "data.paths=[CORPUS]",
                           "data.tokenizer=/nonexistent/tok.model"], "tok.model"),
    "truncated idx": (["data.source=indexed", "data.paths=[TRUNC]", "data.tokenizer=TOK"], ".idx"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_fails_early_with_one_line(case, tmp_path, existing_run, capsys):
    overrides, fragment = BAD[case]
    if case in ("missing tokenizer", "truncated idx"):
        from giantmodel.data.indexed import IndexedDatasetWriter
        good = tmp_path / "good"
        with IndexedDatasetWriter(good, np.uint16) as w:
            w.add_document(np.arange(50))
        tok = tmp_path / "tok.model"
        tok.write_bytes(b"not used")
        overrides = [o.replace("CORPUS", str(good)).replace("TRUNC", _truncated_idx(tmp_path))
                     .replace("TOK", str(tok)) for o in overrides]
    before = _snapshot(existing_run)
    code = main(["train", *SMALL, f"run.dir={existing_run}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error:") and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert fragment in err, err
    assert _snapshot(existing_run) == before


def test_bad_input_exit_status_through_the_real_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "giantmodel", "train", "model.num_layer=2",
                           f"run.dir={tmp_path / 'r'}"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: model.num_layer: unknown key")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_version(capsys):
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "giantmodel 0.1.0" in out and "torch" in out and "comm extension" in out


@pytest.mark.timeout(180)
def test_train_then_generate_from_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL, "data.source=synthetic", "train.steps=4", "train.eval_every=2",
                 "train.sample_tokens=0", "model.vocab_size=512", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "step 4 val_loss" in out
    assert (run / "checkpoints" / "latest").is_file()
    # Synthetic data has no tokenizer: sample with a tiny SentencePiece model.
    import inspect
    import json

    from giantmodel.data.tokenizer import train_sentencepiece
    train_sentencepiece(inspect.getsource(json.decoder).splitlines(), tmp_path / "sp", vocab_size=400)
    assert main(["generate", "--run-dir", str(run), "--tokenizer", str(tmp_path / "sp.model"),
                 "--prompt", "def", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip().startswith("def")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nproc_per_node_spawns_ranks_that_match_one_process(tmp_path):
    """`giantmodel train --nproc-per-node 2` runs dp=2 through torch's elastic
    launcher; its losses equal the single-process run of the same config."""
    common = [*SMALL, "data.source=synthetic", "train.steps=3", "train.eval_every=0",
              "train.log_every=1", "train.sample_tokens=0", "checkpoint.every=0",
              "checkpoint.save_final=false", "train.global_batch_size=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *common, f"run.dir={one}"]) == 0
    proc = subprocess.run([sys.executable, "-m", "giantmodel", "train", "--nproc-per-node", "2",
                           *common, f"run.dir={two}"], capture_output=True, text=True,
                          env=_env(), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    la = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(la) == len(lb) == 3
    assert lb == pytest.approx(la, rel=1e-5)


@pytest.mark.parametrize("argv,want", [
    (["estimate", "a.b=1", "--gpu", "h100-sxm", "--nodes", "1", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["estimate", "--gpu", "h100-sxm", "a.b=1", "--nodes", "1", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["plan", "a.b=1", "--gpu", "h100-sxm", "c.d=2", "--nodes", "2", "e.f=3"],
     ["a.b=1", "c.d=2", "e.f=3"]),
    (["train", "a.b=1", "--config", "x.yaml", "c.d=2"], ["a.b=1", "c.d=2"]),
])
def test_overrides_are_taken_wherever_they_stand(argv, want):
    from giantmodel.cli import build_parser, parse_args

    assert parse_args(build_parser(), argv).overrides == want


def test_a_stray_word_is_still_an_error(capsys):
    from giantmodel.cli import build_parser, parse_args

    for argv in (["estimate", "--gpu", "h100-sxm", "--bogus"], ["version", "a.b=1"],
                 ["estimate", "a.b=1", "--gpu", "h100-sxm", "c.d=2", "--bogus"]):
        with pytest.raises(SystemExit):
            parse_args(build_parser(), argv)
        assert "unrecognized arguments" in capsys.readouterr().err
