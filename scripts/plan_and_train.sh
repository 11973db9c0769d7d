#!/usr/bin/env bash
# Let the planner choose the layout for the cluster, then train with it:
#   scripts/plan_and_train.sh configs/llama/13b.yaml a100-80g 2 8
set -euo pipefail
CONFIG=${1:?config}; GPU=${2:?gpu profile}; NODES=${3:-1}; GPN=${4:-8}
OUT=${OUT:-runs/plan-$(basename "$CONFIG" .yaml).yaml}
giantmodel plan --config "$CONFIG" --gpu "$GPU" --nodes "$NODES" --gpus-per-node "$GPN" --out "$OUT"
echo "planned layout written to $OUT"
if [ "${NODES}" -eq 1 ]; then
    torchrun --nproc-per-node "$GPN" -m giantmodel train --config "$OUT"
else
    echo "multi-node: launch scripts/slurm_train.sh $OUT on $NODES nodes"
fi
