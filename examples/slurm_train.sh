#!/usr/bin/env bash
# vitkit on a SLURM cluster: one torchrun per node, one process per GPU, rendezvous on the first node.
#
#   sbatch examples/slurm_train.sh fashion-mnist run.strategy=fsdp run.out_dir=/shared/runs/x
#
# Every node must see the same run.out_dir (a shared file system: checkpoints are written by every rank) and the
# same data: a shard set on shared storage or an http(s):// URL (`vitkit data pack`). Resuming after a preemption
# is the same command: the run continues from its newest checkpoint, at any number of nodes.
#SBATCH --job-name=vitkit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=24:00:00
#SBATCH --requeue
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8   # threads per process for the CPU side (decoding runs in DataLoader workers)

srun torchrun \
  --nnodes "$SLURM_JOB_NUM_NODES" \
  --nproc-per-node "$SLURM_GPUS_PER_NODE" \
  --rdzv-id "$SLURM_JOB_ID" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$head_node:29500" \
  -m vitkit train "$@"
