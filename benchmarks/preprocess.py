"""Tokens/s of `giantmodel preprocess` against a bare single-process tokenize-and-write loop.

Corpus: this Python's standard library sources (the built-in corpus), written
as one jsonl document per file; tokenizer: the built-in corpus's SentencePiece
model. In one process run, best of ``--repeats``:

* baselines: read the jsonl, ``json.loads``, encode, append EOS, write one flat
  uint16 array -- the least work that produces the same tokens -- once with
  ``encode`` per document and once as one batched SentencePiece call (which
  threads over all cores by itself);
* giantmodel: ``preprocess()`` with 1 worker and with ``--workers`` workers,
  which also writes the Megatron-LM ``.idx`` and streams progress.

Both outputs are checked to hold identical tokens. Usage::

    PYTHONPATH=. python benchmarks/preprocess.py [--workers 2] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from giantmodel.data.builtin import ensure_builtin_corpus, stdlib_files
from giantmodel.data.indexed import IndexedDataset
from giantmodel.data.preprocess import preprocess
from giantmodel.data.tokenizer import load_tokenizer


def write_jsonl(path: Path) -> tuple[int, int]:
    files = stdlib_files()
    n_bytes = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            n_bytes += len(text.encode("utf-8"))
            f.write(json.dumps({"text": text}) + "\n")
    return len(files), n_bytes


def _read_texts(jsonl: Path) -> list[str]:
    with open(jsonl, encoding="utf-8") as f:
        return [t for t in (json.loads(line)["text"] for line in f) if t]


def _write_flat(tok, encoded, out: Path) -> int:
    flat = np.concatenate([np.asarray(ids + [tok.eos_id], dtype=np.uint16) for ids in encoded])
    out.write_bytes(flat.tobytes())
    return int(flat.size)


def bare_loop(jsonl: Path, tok_path: Path, out: Path) -> tuple[int, float]:
    """The obvious script: one process, ``encode`` per document."""
    t0 = time.perf_counter()
    tok = load_tokenizer(tok_path)
    n = _write_flat(tok, [tok.encode(t) for t in _read_texts(jsonl)], out)
    return n, time.perf_counter() - t0


def bare_batched(jsonl: Path, tok_path: Path, out: Path) -> tuple[int, float]:
    """One process, one batched SentencePiece call (it threads over all cores itself)."""
    t0 = time.perf_counter()
    tok = load_tokenizer(tok_path)
    n = _write_flat(tok, tok.encode_batch(_read_texts(jsonl)), out)
    return n, time.perf_counter() - t0


def best(fn, repeats: int) -> tuple[int, float]:
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    cache = os.environ.get("GIANTMODEL_CACHE", "~/.cache/giantmodel")
    corpus = ensure_builtin_corpus(cache, progress=False)
    tok_path = corpus.tokenizer
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        jsonl = td / "stdlib.jsonl"
        n_docs, n_bytes = write_jsonl(jsonl)
        bases = {}
        for name, fn in (("bare loop, encode per document", bare_loop),
                         ("bare loop, one batched encode", bare_batched)):
            bases[name] = best(lambda fn=fn: fn(jsonl, tok_path, td / "bare.bin"), args.repeats)
        t_base = min(t for _, t in bases.values())
        ref = np.fromfile(td / "bare.bin", np.uint16)
        rows = []
        for w in sorted({1, args.workers}):
            def run(w=w):
                st = preprocess([str(jsonl)], td / f"gm{w}", tok_path, workers=w, progress=False)
                return st.tokens, st.seconds
            n, t = best(run, args.repeats)
            same = np.array_equal(np.asarray(IndexedDataset(td / f"gm{w}").tokens), ref)
            rows.append({"workers": w, "tokens": n, "seconds": round(t, 3),
                         "tokens_per_sec": round(n / t), "ratio_vs_best_baseline": round(t_base / t, 3),
                         "identical_tokens": bool(same)})
    result = {
        "benchmark": "preprocess", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}",
        "python": platform.python_version(), "corpus": f"stdlib .py files as jsonl: {n_docs} docs, "
        f"{n_bytes / 1e6:.1f} MB", "tokenizer": f"SentencePiece BPE, {load_tokenizer(tok_path).vocab_size} pieces",
        "repeats": args.repeats, "timing": "best of repeats, seconds of wall time",
        "baselines": [{"what": k, "tokens": n, "seconds": round(t, 3), "tokens_per_sec": round(n / t)}
                      for k, (n, t) in bases.items()],
        "giantmodel": rows,
    }
    print(f"{'pipeline':<36}{'tokens':>12}{'seconds':>10}{'tokens/s':>14}{'vs best bare':>14}")
    for k, (n, t) in bases.items():
        print(f"{k:<36}{n:>12,}{t:>10.2f}{n / t:>14,.0f}{t_base / t:>14.2f}")
    for r in rows:
        name = f"giantmodel preprocess, {r['workers']} worker(s)"
        print(f"{name:<36}{r['tokens']:>12,}{r['seconds']:>10.2f}{r['tokens_per_sec']:>14,}"
              f"{r['ratio_vs_best_baseline']:>14.2f}" + ("" if r["identical_tokens"] else "  TOKENS DIFFER"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if all(r["identical_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
