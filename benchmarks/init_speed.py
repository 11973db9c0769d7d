"""Time to build and initialise a LLaMA-1B-class model in one process.

``build_model`` on the meta device, then ``init_weights`` on the CPU (the
path every rank takes before training from scratch), in a fresh process so
that its peak resident set (``ru_maxrss``) is its own. "legacy" re-enacts
the initialisation before row chunks (one CPU draw of each full parameter
into a new tensor, then a copy); "chunked" is giantmodel's ``init_weights``.
The two alternate, so that both see the same load on a shared host. The shape is the one
scripts/gpu_check.sh benchmarks: hidden 2048, 16 layers, 32 heads, 8 k/v
heads, ffn 8192, vocabulary 128,256, untied embeddings (1.50 B parameters,
5.6 GiB in fp32).

    PYTHONPATH=. python benchmarks/init_speed.py [--threads 2] [--repeat 2]

Prints a table and appends to benchmarks/results/init_speed.json (with the
commit it ran at, so that runs before and after a change sit side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(arch="llama", name="llama-1b-class", hidden_size=2048, num_layers=16, num_heads=32,
             num_kv_heads=8, ffn_hidden_size=8192, vocab_size=128256, max_seq_len=4096)


def legacy_init(model, cfg, seed: int) -> None:
    """The initialisation before row chunks (commit 3dab48f), for one process:
    each parameter's full value drawn by one CPU generator into a new tensor,
    then copied into the parameter."""
    import zlib

    import torch

    from giantmodel.models.registry import _init_std, canonical_name

    model.to_empty(device="cpu")
    seen = set()
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = canonical_name(fqn)
        std = _init_std(name, cfg)
        if std is None:
            full = torch.full(tuple(p.shape), 0.0 if name.endswith("bias") else 1.0)
        else:
            gen = torch.Generator().manual_seed(
                (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            full = torch.empty(tuple(p.shape)).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            p.copy_(full)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(device="cpu")


def child(impl: str, threads: int) -> dict:
    import torch

    from giantmodel.config.model import ModelConfig
    from giantmodel.models.registry import build_model, count_params, init_weights

    torch.set_num_threads(threads)
    cfg = ModelConfig(**SHAPE)
    t0 = time.perf_counter()
    model = build_model(cfg, device="meta")
    t1 = time.perf_counter()
    if impl == "legacy":
        legacy_init(model, cfg, seed=1234)
    else:
        init_weights(model, cfg, seed=1234, device="cpu")
    t2 = time.perf_counter()
    params = count_params(model)
    # A checksum, so a later run can tell whether the values changed.
    first = next(model.parameters())
    return {"params": params, "build_s": t1 - t0, "init_s": t2 - t1,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "model_gib": params * 4 / 2**30, "first_param_sum": float(first.double().sum()),
            "threads": threads, "impl": impl, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeat", type=int, default=2, help="fresh processes per implementation")
    ap.add_argument("--impls", default="legacy,chunked",
                    help="comma list: legacy (the unchunked CPU draw, re-enacted here), chunked "
                         "(giantmodel's init_weights); alternated so both see the same load")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    rows = []
    for impl in [i for _ in range(args.repeat) for i in args.impls.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--child", impl, "--threads", str(args.threads)],
                             capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        if out.returncode:
            sys.exit(f"the measuring process failed:\n{out.stderr}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| implementation | params | build s | init s | peak RSS GiB | model fp32 GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['params'] / 1e9:.2f} B | {r['build_s']:.2f} | {r['init_s']:.1f} | "
              f"{r['peak_rss_gib']:.2f} | {r['model_gib']:.2f} |")
    root = Path(__file__).parents[1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
              "loadavg": os.getloadavg(), "shape": SHAPE, "runs": rows}
    # Appended, so that a before/after pair stays side by side.
    path = Path(__file__).parent / "results" / "init_speed.json"
    path.parent.mkdir(exist_ok=True)
    history = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(history + [result], indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
