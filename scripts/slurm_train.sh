#!/usr/bin/env bash
# Multi-node training under Slurm: one torchrun per node, c10d rendezvous on
# the first node. Usage:
#   sbatch --nodes 4 scripts/slurm_train.sh configs/llama/65b.yaml parallel.tp=8 parallel.pp=4
# Environment: GPUS_PER_NODE (8: ranks per node), MASTER_PORT (29500),
# MAX_RESTARTS (0). parallel.placement=auto places ranks by measured link
# bandwidth (docs/placement.md). Tested on an emulated cluster with the srun
# and scontrol stand-ins in scripts/slurm-shim/ (tests/test_cluster_launch.py).
#SBATCH --job-name=giantmodel
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch scripts/slurm_train.sh CONFIG [KEY=VALUE ...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-29500}

# NCCL on InfiniBand / RoCE clusters; adjust to your fabric.
export NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# A node whose agent is restarted (MAX_RESTARTS) can rejoin only if every
# rendezvous round publishes the workers' store address anew; torch 2.13 skips
# that when the agents share one TCP store (its default).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
mkdir -p logs
srun --kill-on-bad-exit=1 "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$PORT" --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    -m giantmodel train --config "$CONFIG" "$@"
