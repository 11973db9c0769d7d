#!/usr/bin/env bash
# Validate a GPU host for giantmodel in one command (issue 33), from the repository root:
#     bash scripts/gpu_check.sh                 # results under $OUT (default: a new temp folder)
# Needs NVIDIA GPU(s) and torch preinstalled; no network. At most ~8 minutes on one H100:
# no new step starts after BUDGET_S seconds (default 450), and each step is capped to what
# is left. Steps, most useful first; every step is independent (a failure is recorded and
# the next one runs):
#   1. versions (GPU, driver, torch, CUDA, NCCL) and whether the C++ comm core builds
#   2. pytest -m gpu (and the CUDA comm tests)
#   3. the layout harness on 1 GPU in bf16 against the CPU fp32 run (scripts/gpu_layouts.py)
#   4. giantmodel bench train, LLaMA-1B class (hidden 2048, 16 layers, 32/8 heads, ffn 8192,
#      vocab 128256, seq 4096, bf16, micro-batch 1): tokens/s, MFU, peak memory
#   5. the same model as a plain PyTorch loop (scripts/gpu_baseline.py: HF LlamaForCausalLM,
#      SDPA, fused AdamW, bf16 autocast) and the ratio of the two
#   6. async checkpoint save and exact resume (scripts/gpu_resume_check.py)
#   7. activation offload: peak memory with and without
#   8. with 2+ GPUs: dp2, tp2, pp2, cp2 over NCCL against one GPU (scripts/gpu_layouts.py multi)
#   9. step 4 with the plain (full-logits) loss, to show what the chunked loss saves
#  10. the optional accelerations, each where installed: fp8 (Transformer Engine, torchao
#      float8) and apex, a few steps of a small LLaMA against bf16 (scripts/gpu_accel_check.py)
# Writes $OUT/summary.txt, $OUT/summary.json and $OUT/logs.tgz (one log per step): the
# device tool brings back at most 8 files.
# Exits 1 when a step failed. Without CUDA it says so and exits 0 in seconds. GM_CHECK_CPU=1 runs every step on the CPU
# with tiny shapes instead, to check this script itself.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gm-gpu-check.XXXXXX")}
mkdir -p "$OUT"
L=$(mktemp -d "${TMPDIR:-/tmp}/gm-gpu-logs.XXXXXX")
R=$(mktemp -d "${TMPDIR:-/tmp}/gm-gpu-runs.XXXXXX")
S="$OUT/summary.txt"; : >"$S"
STEPS_JSONL="$L/steps.jsonl"; : >"$STEPS_JSONL"
BUDGET_S=${BUDGET_S:-450}
trap 'tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null; rm -rf "$R"' EXIT

if [[ -z ${PYTHON:-} && -x /opt/torch/.venv/bin/python3 ]]; then PYTHON=/opt/torch/.venv/bin/python3; fi
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export GIANTMODEL_CACHE=${GIANTMODEL_CACHE:-$R/cache}

say() { echo "$*" | tee -a "$S"; }
left() {  # seconds a step may take: its cap, or what the budget leaves; fails when spent
  local l=$((BUDGET_S - SECONDS))
  ((l > 20)) || return 1
  echo $((l < $1 ? l : $1))
}
# record NAME STATUS SECONDS: one line of steps.jsonl; $L/NAME.json (when a step wrote one) is its result
record() {
  "$PY" - "$1" "$2" "$3" "$L/$1.json" >>"$STEPS_JSONL" 2>/dev/null <<'EOF'
import json, sys
name, status, secs, path = sys.argv[1:]
row = {"step": name, "status": status, "seconds": int(secs)}
try:
    with open(path) as f:
        row["result"] = json.loads(f.read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    pass
print(json.dumps(row))
EOF
}
# step NAME CAP_S FUNCTION: runs FUNCTION under a timeout, logs to $L/NAME.log, records the outcome
step() {
  local name=$1 cap=$2 fn=$3 t t0 rc status
  if ! t=$(left "$cap"); then
    say "-- $name: skipped (budget of ${BUDGET_S}s spent)"; record "$name" skipped 0; return
  fi
  t0=$SECONDS; STEP_END=$((SECONDS + t))
  "$fn" >"$L/$name.log" 2>&1; rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; 3) status=skipped ;; *) status=FAIL ;; esac
  say "-- $name: $status in $((SECONDS - t0))s (cap ${t}s)"
  [[ $status == ok ]] || tail -n 5 "$L/$name.log" | sed 's/^/   | /' | tee -a "$S"
  record "$name" "$status" $((SECONDS - t0))
}
# run CMD...: under what is left of the step's time (a step of several commands shares it)
run() {
  local t=$((STEP_END - SECONDS))
  ((t > 0)) || return 124
  timeout -k 10 "$t" "$@"
}
last_json() { grep -E '^\{' "$1" | tail -n 1; }  # a step's result: the last JSON line it printed

# ------------------------------------------------------------------ is there a GPU?
if [[ ${GM_CHECK_CPU:-0} == 1 ]]; then
  DEV=cpu; NGPU=2
  say "GM_CHECK_CPU=1: every step on the CPU with tiny shapes (a check of this script)"
else
  DEV=cuda
  NGPU=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
  if [[ -z $NGPU || $NGPU == 0 ]]; then
    say "no CUDA GPU visible here (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-unset}'): nothing to check"
    echo '{"gpu": false, "steps": []}' >"$OUT/summary.json"
    exit 0
  fi
fi
say "giantmodel GPU check: $NGPU GPU(s), budget ${BUDGET_S}s, results in $OUT"

if [[ $DEV == cuda ]]; then
  # LLaMA-1B class (Llama 3.2 1B's shape: tied embeddings, rope theta 500k)
  HID=2048 LAY=16 HEADS=32 KV=8 FFN=8192 VOC=128256 SEQ=4096 ACC=8 WARM=3 ITERS=8
  # offload: a smaller model whose activations (about 285 MB a block at seq 4096) dominate
  OFF="model.hidden_size=2048 model.num_layers=8 model.num_heads=16 model.num_kv_heads=8 model.ffn_hidden_size=5632 model.vocab_size=32000 model.max_seq_len=4096 train.seq_len=4096"
else
  HID=64 LAY=2 HEADS=4 KV=2 FFN=128 VOC=256 SEQ=64 ACC=2 WARM=1 ITERS=2
  OFF="model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.ffn_hidden_size=128 model.vocab_size=256 model.max_seq_len=64 train.seq_len=64"
fi
PREC=$([[ $DEV == cuda ]] && echo bf16 || echo fp32)
M="model.name=llama-1b model.hidden_size=$HID model.num_layers=$LAY model.num_heads=$HEADS model.num_kv_heads=$KV model.ffn_hidden_size=$FFN model.vocab_size=$VOC model.max_seq_len=$SEQ model.rope_theta=500000 model.tie_embeddings=true"
D="data.source=synthetic data.synthetic_pattern=random train.device=$DEV precision=$PREC train.seq_len=$SEQ train.micro_batch_size=1 train.global_batch_size=$ACC recompute=none"

# ------------------------------------------------------------------ the steps
s1_versions() {
  [[ $DEV == cuda ]] && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  run "$PY" -c "
import json, torch
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,
                  'nccl': '.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                  'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
" >"$L/versions.json" || return 1
  cat "$L/versions.json"
  if [[ $DEV == cuda ]]; then run "$PY" csrc/build_ext.py || echo "comm core build FAILED"
  else echo "CPU check mode: no build (it would write into the checkout)"; fi
  run "$PY" -c "
import json
from giantmodel.comm import _lib
lib = _lib.load()
print(json.dumps({'comm_core_built': lib is not None, 'load_error': _lib.load_error()}))
" | tee "$L/s1_versions.json"
  "$PY" -c "import json,sys; v=json.load(open('$L/versions.json')); c=json.load(open('$L/s1_versions.json')); v.update(c); print(json.dumps(v))" >"$L/s1_versions.json.tmp" \
    && mv "$L/s1_versions.json.tmp" "$L/s1_versions.json"
}
s2_pytest_gpu() {
  local rc=0
  run "$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu tests || rc=$?
  ((rc == 5)) && rc=0  # 5: no test selected (a CPU check)
  run "$PY" -m pytest -q -p no:cacheprovider tests/test_comm_cuda.py || { r=$?; ((r == 5)) || rc=$r; }
  return $rc
}
s3_layout_1gpu() {
  GM_CHECK_DEVICE=$DEV run "$PY" scripts/gpu_layouts.py single; local rc=$?
  last_json "$L/s3_layout_1gpu.log" >"$L/s3_layout_1gpu.json"; return $rc
}
s4_bench_1b() {
  run "$PY" -m giantmodel bench train --warmup $WARM --steps $ITERS --json $M $D >"$L/bench.out" || return 1
  cat "$L/bench.out"; "$PY" -c "import json,sys; print(json.dumps(json.load(open('$L/bench.out'))))" >"$L/s4_bench_1b.json"
}
s5_hf_baseline() {
  run "$PY" scripts/gpu_baseline.py --device $DEV --precision $PREC --hidden $HID --layers $LAY --heads $HEADS \
    --kv-heads $KV --ffn $FFN --vocab $VOC --seq $SEQ --micro-batch 1 --accum $ACC --warmup $WARM \
    --steps $ITERS --tie --rope-theta 500000; local rc=$?
  last_json "$L/s5_hf_baseline.log" >"$L/s5_hf_baseline.json"; return $rc
}
s6_resume() {
  run "$PY" scripts/gpu_resume_check.py --device $DEV --dir "$R/resume"; local rc=$?
  last_json "$L/s6_resume.log" >"$L/s6_resume.json"; return $rc
}
s7_offload() {
  local base="data.source=synthetic train.device=$DEV precision=$PREC train.micro_batch_size=1 train.global_batch_size=1 recompute=none $OFF"
  run "$PY" -m giantmodel bench train --warmup 2 --steps 3 --json $base >"$L/off0.out" || return 1
  run "$PY" -m giantmodel bench train --warmup 2 --steps 3 --json $base offload.activations=true >"$L/off1.out" || return 1
  "$PY" - "$L/off0.out" "$L/off1.out" <<'EOF' | tee "$L/s7_offload.json"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
print(json.dumps({"peak_bytes_without": a["peak_memory_bytes"], "peak_bytes_with": b["peak_memory_bytes"],
                  "saved_bytes": a["peak_memory_bytes"] - b["peak_memory_bytes"],
                  "tokens_per_sec_without": a["tokens_per_sec"], "tokens_per_sec_with": b["tokens_per_sec"]}))
EOF
}
s8_layouts_nccl() {
  GM_CHECK_DEVICE=$DEV run "$PY" scripts/gpu_layouts.py multi; local rc=$?
  last_json "$L/s8_layouts_nccl.log" >"$L/s8_layouts_nccl.json"; return $rc
}
s9_bench_1b_plain_loss() {
  run "$PY" -m giantmodel bench train --warmup $WARM --steps $ITERS --json $M $D train.loss_impl=plain >"$L/bench_plain.out" || return 1
  "$PY" -c "import json; print(json.dumps(json.load(open('$L/bench_plain.out'))))" >"$L/s9_bench_1b_plain_loss.json"
}

step s1_versions 150 s1_versions
step s2_pytest_gpu 150 s2_pytest_gpu
step s3_layout_1gpu 120 s3_layout_1gpu
step s4_bench_1b 200 s4_bench_1b
step s5_hf_baseline 150 s5_hf_baseline
step s6_resume 120 s6_resume
step s7_offload 150 s7_offload
if ((NGPU >= 2)); then step s8_layouts_nccl 240 s8_layouts_nccl
else say "-- s8_layouts_nccl: skipped (one GPU)"; record s8_layouts_nccl skipped 0; fi
step s9_bench_1b_plain_loss 200 s9_bench_1b_plain_loss
# Last and separate: optional packages; "skipped" (exit 3) where none is installed or usable.
s10_accelerations() {
  run "$PY" scripts/gpu_accel_check.py; local rc=$?
  last_json "$L/s10_accelerations.log" >"$L/s10_accelerations.json"; return $rc
}
step s10_accelerations 90 s10_accelerations

# ------------------------------------------------------------------ summary
"$PY" - "$STEPS_JSONL" "$OUT/summary.json" "$SECONDS" <<'EOF' | tee -a "$S"
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
res = {r["step"]: r.get("result", {}) for r in rows}
out = {"gpu": True, "seconds": int(sys.argv[3]), "steps": rows}
gm, hf, plain = res.get("s4_bench_1b", {}), res.get("s5_hf_baseline", {}), res.get("s9_bench_1b_plain_loss", {})
lines = [f"versions: {json.dumps(res.get('s1_versions', {}))}"]
if gm:
    lines.append(f"giantmodel 1B: {gm['tokens_per_sec']:,.0f} tokens/s, MFU {gm['mfu']:.1%}, "
                 f"peak {gm['peak_memory_bytes'] / 2**30:.1f} GiB")
if hf:
    lines.append(f"HF + torch loop 1B: {hf['tokens_per_sec']:,.0f} tokens/s, MFU {hf['mfu']:.1%}, "
                 f"peak {(hf['peak_memory_bytes'] or 0) / 2**30:.1f} GiB")
if gm and hf:
    out["giantmodel_over_hf_tokens_per_sec"] = gm["tokens_per_sec"] / hf["tokens_per_sec"]
    lines.append(f"ratio giantmodel / HF loop: {out['giantmodel_over_hf_tokens_per_sec']:.3f}")
if gm and plain:
    lines.append(f"plain loss 1B: {plain['tokens_per_sec']:,.0f} tokens/s, peak "
                 f"{plain['peak_memory_bytes'] / 2**30:.1f} GiB (chunked saves "
                 f"{(plain['peak_memory_bytes'] - gm['peak_memory_bytes']) / 2**30:.2f} GiB)")
off = res.get("s7_offload")
if off:
    lines.append(f"activation offload: peak {off['peak_bytes_without'] / 2**30:.2f} -> "
                 f"{off['peak_bytes_with'] / 2**30:.2f} GiB, tokens/s {off['tokens_per_sec_without']:,.0f} -> "
                 f"{off['tokens_per_sec_with']:,.0f}")
failed = [r["step"] for r in rows if r["status"] in ("FAIL", "timeout")]
lines.append(f"steps: {sum(r['status'] == 'ok' for r in rows)} ok, failed: {failed or 'none'}; "
             f"{out['seconds']}s")
out["failed"] = failed
json.dump(out, open(sys.argv[2], "w"), indent=2)
print("\n".join(lines))
EOF
say "logs: $OUT/logs.tgz"
# 1 when a step failed or timed out (the files under $OUT say which)
"$PY" -c "import json,sys; sys.exit(1 if json.load(open('$OUT/summary.json'))['failed'] else 0)"
