"""Pictures: `giantmodel plot`, `estimate --plot`, `plan --plot`, and the
pipeline timeline they are drawn from."""

from __future__ import annotations

import json
import sys

import pytest

from giantmodel.cli import main
from giantmodel.planner.plots import bubble_fraction, memory_categories, pipeline_timeline

PNG = b"\x89PNG\r\n\x1a\n"
PP4 = ["--gpu", "h100-sxm", "--gpus-per-node", "4", "parallel.pp=4",
       "train.global_batch_size=64"]


def _png(path, min_bytes=15_000):
    data = path.read_bytes()
    assert data[:8] == PNG
    assert min_bytes < len(data) < 5_000_000
    # IHDR: a picture of plausible size, not an empty canvas
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 500 and height >= 400


def _run(tmp_path, name, steps, loss0, resumed_from=None):
    run = tmp_path / name
    run.mkdir()
    rows = []
    for s in steps:
        rows.append({"step": s, "loss": loss0 - 0.01 * s, "lr": 1e-3 * s / steps[-1],
                     "grad_norm": 1.0 / s, "tokens_per_sec": 1000.0 + s, "mfu": 0.1,
                     "tokens": 512 * s})
        if s % 10 == 0:
            rows.append({"step": s, "val_loss": loss0 - 0.01 * s + 0.1})
    if resumed_from is not None:   # a restart re-logs the steps after its checkpoint
        rows += [{"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5,
                  "tokens_per_sec": 2000.0, "tokens": 512 * s}
                 for s in range(resumed_from, steps[-1] + 1, 5)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + '{"step": 99, "lo')   # a torn last line
    return run


def test_plot_runs_overlaid_with_summary(tmp_path, capsys):
    a = _run(tmp_path, "run-a", list(range(1, 41)), 5.0)
    b = _run(tmp_path, "run-b", list(range(5, 61, 5)), 6.0, resumed_from=30)
    out = tmp_path / "runs.png"
    assert main(["plot", str(a), str(b), "--out", str(out), "--smooth", "0.6"]) == 0
    _png(out)
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:2] == ["run", "steps"]
    row_a = text[1].split()
    assert row_a[:5] == ["run-a", "40", f"{4.99:.4f}", f"{4.6:.4f}", f"{4.7:.4f}"]
    row_b = text[2].split()
    # the resumed run: the re-logged steps win (last loss 1.0), the val rows stay
    assert row_b[:5] == ["run-b", "60", f"{5.95:.4f}", f"{1.0:.4f}", f"{5.5:.4f}"]
    out2 = tmp_path / "tokens.png"
    assert main(["plot", str(a), "--out", str(out2), "--x", "tokens"]) == 0
    _png(out2)
    assert main(["plot", str(a), "--out", str(out2), "--smooth", "1.5"]) == 2
    assert main(["plot", str(tmp_path / "nope"), "--out", str(out2)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_estimate_plot_keeps_the_text(tmp_path, capsys):
    assert main(["estimate", *PP4]) == 0
    plain = capsys.readouterr().out
    out = tmp_path / "mem.png"
    assert main(["estimate", *PP4, "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert f"wrote {out}" in captured.err
    _png(out)


def test_memory_categories_cover_every_component():
    comp = {"params": 1.0, "working_weights": 2.0, "grads": 4.0, "grads_not_yet_allocated": -1.0,
            "optimizer": 8.0, "activations": 16.0, "embedding_head_activations": 32.0,
            "backward_transient": 64.0, "comm_buffers": 128.0, "reserved": 256.0,
            "something_new": 512.0}
    cats = memory_categories(comp)
    assert cats == {"parameters": 3.0, "gradients": 3.0, "optimizer states": 8.0,
                    "activations": 112.0, "buffers": 896.0}
    assert sum(cats.values()) == sum(comp.values())


def test_plan_plot(tmp_path, capsys):
    out = tmp_path / "plan.png"
    args = ["plan", "--gpu", "h100-sxm", "--gpus-per-node", "4", "--top", "3"]
    assert main([*args, "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert "top layouts on" in captured.out and f"wrote {out}" in captured.err
    _png(out)


def test_missing_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    # a None entry makes `import matplotlib` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = _run(tmp_path, "run", [1, 2, 3], 3.0)
    out = tmp_path / "x.png"
    for argv in (["plot", str(run), "--out", str(out)], ["estimate", "--plot", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install matplotlib" in err[0], err
    assert not out.exists()


def _check_order(blocks):
    """Each forward after its producer's, each backward after the next
    stage's, no two blocks of a rank overlapping."""
    end = {(b.kind, b.stage, b.micro): b.end for b in blocks}
    for b in blocks:
        if b.kind == "F" and b.stage > 0:
            assert b.start >= end[("F", b.stage - 1, b.micro)] - 1e-12
        if b.kind == "B" and ("B", b.stage + 1, b.micro) in end:
            assert b.start >= end[("B", b.stage + 1, b.micro)] - 1e-12
        if b.kind == "W":
            assert b.start >= end[("B", b.stage, b.micro)] - 1e-12
    for r in {b.rank for b in blocks}:
        mine = sorted((b.start, b.end) for b in blocks if b.rank == r)
        assert all(e <= s + 1e-12 for (_, e), (s, _) in zip(mine, mine[1:]))


def test_timeline_1f1b_and_its_bubble():
    pp, m = 4, 8
    blocks = pipeline_timeline("1f1b", pp, 1, m, fwd=1.0, bwd=2.0)
    _check_order(blocks)
    for r in range(pp):
        kinds = [b.kind for b in sorted(blocks, key=lambda b: b.start) if b.rank == r]
        assert kinds.count("F") == m and kinds.count("B") == m and "W" not in kinds
        # warm-up of pp - r - 1 forwards, then one forward and one backward in turn
        assert kinds[:pp - r] == ["F"] * (pp - r) and kinds[pp - r] == "B"
    assert bubble_fraction(blocks) == pytest.approx((pp - 1) / (m + pp - 1))
    assert max(b.end for b in blocks) == pytest.approx((m + pp - 1) * 3.0)
    assert bubble_fraction(pipeline_timeline("gpipe", pp, 1, m, 1.0, 2.0)) == pytest.approx(
        (pp - 1) / (m + pp - 1))


def test_timeline_interleaved_and_zero_bubble_shrink_the_bubble():
    pp, m, v = 4, 8, 2
    inter = pipeline_timeline("interleaved_1f1b", pp, v, m, 1.0, 2.0)
    _check_order(inter)
    assert {b.stage for b in inter if b.rank == 1} == {1, 5}
    # Megatron's interleaved bubble: (pp - 1) / (v m + pp - 1)
    assert bubble_fraction(inter) == pytest.approx((pp - 1) / (v * m + pp - 1))
    zb = pipeline_timeline("zero_bubble", pp, 1, m, 1.0, 2.0)
    _check_order(zb)
    assert sum(b.kind == "W" for b in zb) == pp * m
    # ZB-H1 with B = W: the bubble is (pp - 1)(F + B - W), a third of 1F1B's here
    assert max(b.end for b in zb) == pytest.approx(m * 3.0 + (pp - 1) * 1.0)
    zbv = pipeline_timeline("zbv", pp, 2, m, 1.0, 2.0)
    _check_order(zbv)
    assert {b.stage for b in zbv if b.rank == 0} == {0, 2 * pp - 1}
    assert bubble_fraction(zbv) < (pp - 1) / (m + pp - 1)
