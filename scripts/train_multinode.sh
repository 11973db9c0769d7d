#!/usr/bin/env bash
# Multi-node training without a scheduler: run this on every node with the
# same HEAD_NODE, e.g.
#   HEAD_NODE=10.0.0.1 NNODES=2 scripts/train_multinode.sh configs/llama/13b.yaml
set -euo pipefail
CONFIG=${1:?usage: HEAD_NODE=host NNODES=n scripts/train_multinode.sh CONFIG [KEY=VALUE ...]}
shift
: "${HEAD_NODE:?set HEAD_NODE to the first node's address}"
exec torchrun --nnodes "${NNODES:-1}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:${MASTER_PORT:-29500}" \
    --rdzv-id "${RUN_ID:-giantmodel}" \
    -m giantmodel train --config "$CONFIG" "$@"
