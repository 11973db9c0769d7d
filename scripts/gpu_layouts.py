"""Layout checks for scripts/gpu_check.sh, on tests/layout_harness.py.

    python scripts/gpu_layouts.py single   # 1 GPU, bf16, against the CPU fp32 run
    python scripts/gpu_layouts.py multi    # dp2, tp2, pp2, cp2 over NCCL against 1 GPU

Prints one line per case and a final JSON line; exits 1 when a case fails.
``GM_CHECK_DEVICE=cpu`` runs the same code on the CPU (gloo for ``multi``),
to check the script itself without a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import layout_harness as H  # noqa: E402

DEVICE = os.environ.get("GM_CHECK_DEVICE", "cuda")
STEPS = 5

# bf16 on the GPU against fp32 on the CPU, 5 AdamW steps of the harness's
# tiny models (init std 0.02, so logits stay small and the loss near
# ln(vocab) = 5.5). bf16 keeps 8 significant bits: a rounding moves a value by
# at most 2^-9 (0.2%) of itself. The loss is an fp32 log-softmax of logits
# that carry such roundings, so it can be off by about 0.2% of the logits'
# size, which is far below 0.2% of the loss itself: LOSS_RTOL 2e-3 (one bf16
# rounding of the loss) is already generous. Measured with bf16 autocast
# on the CPU against fp32 (GM_CHECK_DEVICE=cpu): at most 5e-5 over these
# cases; CUDA kernels (flash attention, cuBLAS) round in other places, not
# more often. A wrong kernel (a dropped mask, mis-scaled attention, a missing
# block) moves the loss by whole percents. Gradient norms sum squares of
# bf16-rounded terms: NORM_RTOL 5e-2. Parameters are judged by update, as for
# mixed precision in tests/test_parallel_layouts.py (AdamW turns the rounding
# of a tiny gradient into a full step of either sign): each tensor must stay
# within 25% of how far the reference moved it (measured on the CPU: at most
# 10%, on GPT's; a run that skipped its updates is 100% away).
BF16_LOSS_RTOL, BF16_NORM_RTOL, BF16_UPDATE_RTOL = 2e-3, 5e-2, 0.25
# fp32 on both sides (TF32 off in the harness: torch's default for matmuls):
# only the order of reductions differs (NCCL's ring against one process),
# 1e-5 on the CPU; 1e-4 leaves room for cuBLAS/cuDNN picking different
# kernels per shape (a tp shard is a different shape), still 100x tighter
# than any real layout bug.
FP32_RTOL = 1e-4

SINGLE = [("llama", []), ("gpt", []), ("llama", ["model.tie_embeddings=true"]),
          ("llama", ["train.loss_impl=plain"])]
MULTI = [("llama", ["parallel.dp=2", "parallel.zero=1"]),
         ("llama", ["parallel.dp=2", "parallel.zero=3"]),
         ("llama", ["parallel.tp=2", "parallel.sp=true"]),
         ("llama", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
         ("llama", ["parallel.cp=2"]),
         ("gpt", ["parallel.tp=2"])]


def _worst_loss_rel(result: dict, ref: dict) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"], strict=True))


def single() -> list[dict]:
    rows = []
    for arch, extra in SINGLE:
        label = f"{arch} {' '.join(extra)} bf16 on {DEVICE} vs fp32 on cpu".replace("  ", " ")
        try:
            ref = H.run_steps(H.make_config(arch, extra), STEPS, device="cpu", record_init=True)
            got = H.run_steps(H.make_config(arch, extra + ["precision=bf16"]), STEPS, device=DEVICE)
            worst = H.assert_update_matches(got, ref, label, loss_rtol=BF16_LOSS_RTOL,
                                            norm_rtol=BF16_NORM_RTOL,
                                            update_rtol=BF16_UPDATE_RTOL)
            rows.append({"case": label, "ok": True, "loss_rel": _worst_loss_rel(got, ref),
                         "worst_update_ratio": worst})
        except Exception as e:  # noqa: BLE001 - one failed case must not hide the others
            rows.append({"case": label, "ok": False, "error": _short(e)})
    return rows


def _rank_cases(rank: int, world: int, cases: list) -> list:
    if DEVICE == "cuda":
        import torch

        torch.cuda.set_device(rank)  # NCCL needs one device per rank
    out = []
    for arch, overrides in cases:
        try:
            res = H.run_steps(H.make_config(arch, overrides), STEPS, device=DEVICE)
            res["params"] = {k: v.numpy() for k, v in res["params"].items()}
            res.pop("start", None)
        except Exception:  # noqa: BLE001 - reported per case
            res = {"error": traceback.format_exc()[-1500:]}
        out.append(res if rank == 0 else None)
    return out


def multi() -> list[dict]:
    from giantmodel.testing import run_ranks

    backend = "nccl" if DEVICE == "cuda" else "gloo"
    results = run_ranks(_rank_cases, 2, MULTI, timeout=400, backend=backend,
                        start="spawn")[0]
    rows = []
    for (arch, overrides), got in zip(MULTI, results, strict=True):
        label = f"{arch} {' '.join(overrides)} over {backend} vs 1 {DEVICE}"
        try:
            if "error" in got:
                raise RuntimeError(got["error"])
            kept = [o for o in overrides if not o.startswith("parallel.")]
            ref = H.run_steps(H.make_config(arch, kept), STEPS, device=DEVICE)
            H.assert_matches(got, ref, label, loss_rtol=FP32_RTOL, param_tol=FP32_RTOL,
                             norm_rtol=FP32_RTOL)
            rows.append({"case": label, "ok": True, "loss_rel": _worst_loss_rel(got, ref)})
        except Exception as e:  # noqa: BLE001
            rows.append({"case": label, "ok": False, "error": _short(e)})
    return rows


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[-600:]}"


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "single"
    rows = single() if mode == "single" else multi()
    for r in rows:
        detail = (f"loss rel {r['loss_rel']:.1e}" + (f", worst update {r['worst_update_ratio']:.3f}"
                                                     if "worst_update_ratio" in r else "")
                  if r["ok"] else r["error"])
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}: {detail}", flush=True)
    print(json.dumps({"mode": mode, "device": DEVICE, "cases": rows}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
