"""The optional accelerations on a GPU: fp8 linears and apex, against bf16.

For each one installed here (Transformer Engine with current and delayed
scaling, torchao float8 tensorwise and rowwise, apex fused norms with
FusedAdam), a small LLaMA (every linear side a multiple of 16) is built
with the swap, initialised with the weights of the plain model, and trained
a few steps beside the plain bf16 model on the same batch. It checks that
the first loss is within 2% of bf16's (fp8's e4m3 keeps 3 mantissa bits; the
loss of a random model is an average over many logits, where rounding
errors cancel) and that the loss falls. Prints one JSON line. Exit 3 (the
check script's "skipped") when no case applies: no CUDA, or nothing
installed, or fp8 cases on a GPU older than compute capability 8.9.

    python scripts/gpu_accel_check.py
"""

from __future__ import annotations

import importlib
import json
import sys

import torch
import torch.nn.functional as F

from giantmodel.config.model import ModelConfig
from giantmodel.config.train import OptimConfig
from giantmodel.core.optim import build_adamw
from giantmodel.models.registry import build_model, init_weights
from giantmodel.parallel.accel import Accelerations

CFG = ModelConfig(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4, ffn_hidden_size=1536,
                  vocab_size=4096, max_seq_len=256)
STEPS, TOL = 5, 0.02


def _has(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _cases() -> dict[str, tuple[Accelerations, str]]:
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    cases = {}
    if fp8 and _has("transformer_engine.pytorch"):
        cases["te_current"] = (Accelerations(fp8="te", recipe="current"), "fp8")
        cases["te_delayed"] = (Accelerations(fp8="te", recipe="delayed"), "fp8")
    if fp8 and _has("torchao.float8"):
        cases["torchao_tensorwise"] = (Accelerations(fp8="torchao", recipe="tensorwise"), "fp8")
        cases["torchao_rowwise"] = (Accelerations(fp8="torchao", recipe="rowwise"), "fp8")
    if _has("apex.normalization") and _has("apex.optimizers"):
        cases["apex_norms_fused_adam"] = (Accelerations(apex_norms=True), "bf16")
    return cases


def _losses(acc: Accelerations, mode: str, optim_impl: str, batch: torch.Tensor) -> list[float]:
    model = build_model(CFG)
    acc.apply(model, [model.layers[k] for k in model.layers])
    init_weights(model, CFG, seed=7, device="cuda")
    opt = build_adamw(model.parameters(), OptimConfig(lr=1e-3, impl=optim_impl), "cuda")
    precision = acc.precision(mode, "cuda")
    out = []
    for _ in range(STEPS):
        with precision.autocast():
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 3
    cases = _cases()
    if not cases:
        print(json.dumps({"skipped": "no transformer_engine / torchao float8 / apex usable here",
                          "capability": torch.cuda.get_device_capability()}))
        return 3
    torch.manual_seed(0)
    batch = torch.randint(0, CFG.vocab_size, (4, 257), device="cuda")
    ref = _losses(Accelerations(), "bf16", "fused", batch)
    result, ok = {"bf16": ref}, True
    for name, (acc, mode) in cases.items():
        try:
            got = _losses(acc, mode, "apex" if acc.apex_norms else "fused", batch)
        except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
            result[name], ok = {"error": f"{type(e).__name__}: {e}"}, False
            continue
        rel = abs(got[0] - ref[0]) / ref[0]
        passed = rel < TOL and got[-1] < got[0]
        result[name] = {"losses": got, "first_loss_rel_diff": rel, "ok": passed}
        ok &= passed
        print(f"{name}: first loss {got[0]:.4f} vs bf16 {ref[0]:.4f} (rel {rel:.2e}), "
              f"last {got[-1]:.4f}: {'ok' if passed else 'FAIL'}")
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
