#!/usr/bin/env bash
# Multi-node training without a scheduler: run this on every node with the
# same HEAD_NODE; the torchrun agents meet by c10d rendezvous on HEAD_NODE.
#   HEAD_NODE=10.0.0.1 NNODES=2 scripts/train_multinode.sh configs/llama/13b.yaml parallel.tp=8
# Environment: NNODES (1), GPUS_PER_NODE (8: ranks per node), MASTER_PORT (29500),
# RUN_ID (giantmodel: the rendezvous id, the same on every node),
# MAX_RESTARTS (0: a lost node ends the job; N: restart workers up to N times,
# waiting for the lost node's agent to rejoin, and resume from the last checkpoint).
# Rank placement: parallel.placement=auto measures the links at start-up (see
# docs/placement.md).
set -euo pipefail
CONFIG=${1:?usage: HEAD_NODE=host NNODES=n scripts/train_multinode.sh CONFIG [KEY=VALUE ...]}
shift
: "${HEAD_NODE:?set HEAD_NODE to the address of the first node}"
# A node whose agent is restarted (MAX_RESTARTS) can rejoin only if every
# rendezvous round publishes the workers' store address anew; torch 2.13 skips
# that when the agents share one TCP store (its default).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes "${NNODES:-1}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:${MASTER_PORT:-29500}" \
    --rdzv-id "${RUN_ID:-giantmodel}" --max-restarts "${MAX_RESTARTS:-0}" \
    -m giantmodel train --config "$CONFIG" "$@"
