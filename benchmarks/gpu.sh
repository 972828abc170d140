#!/usr/bin/env bash
# The GPU measurements of the README's performance section, in two parts that each fit a 10-minute slot:
#
#   bash benchmarks/gpu.sh peers     # the device; vitkit vs timm and HF (B/16, L/16, bf16, eager); every
#                                    # registered model (`vitkit bench`); the Fashion-MNIST preset on CUDA
#   bash benchmarks/gpu.sh strategies # one GPU: the plain loop vs DDP and FSDP2 at world size 1 (B/16, bf16),
#                                    # activation checkpointing's memory and speed for L/16 and H/14, MFU
#   bash benchmarks/gpu.sh scaling   # where a step's time goes (gpu_profile.py); the scaling table (B/16, L/16,
#                                    # bf16); vitkit vs timm, both compiled; B/16 training at batch 128
#
# Needs torch with CUDA, timm and transformers importable (vitkit runs from this checkout), and for the
# trainer Fashion-MNIST where `vitkit train` finds it ($VITKIT_DATA). Logs and JSON go to ${OUT:-gpu-results}.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

case "${1:-peers}" in
peers)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
  "$py" -c "import torch, timm, transformers; print('torch', torch.__version__, 'timm', timm.__version__, 'transformers', transformers.__version__)"
  timeout 260 "$py" benchmarks/peers.py --device cuda --lowp-stream --rounds 3 --seconds 1.5 --batch-infer 256 --batch-train 64 \
    --cases vit_b16:infer:bf16 vit_b16:train:bf16 vit_l16:infer:bf16 vit_l16:train:bf16 --json "$out/peers_eager.json" \
    2>&1 | grep -v "model shards" | tee "$out/peers_eager.log"
  timeout 200 "$py" benchmarks/registry.py --device cuda --dtype bf16 --batch 64 --train --train-batch 32 --seconds 0.5 \
    --json "$out/registry.json" 2>&1 | tee "$out/registry.log"
  rm -rf /tmp/fm /tmp/fm16
  ( time timeout 120 "$py" -m vitkit train fashion-mnist run.device=cuda run.out_dir=/tmp/fm ) 2>&1 | tail -n 12 | tee "$out/train.log"
  timeout 30 "$py" -m vitkit eval /tmp/fm/best.safetensors --data fashion-mnist --tta flip --device cuda 2>&1 | head -n 2 | tee -a "$out/train.log"
  timeout 60 "$py" -m vitkit train fashion-mnist --smoke run.device=cuda run.precision=fp16 run.out_dir=/tmp/fm16 2>&1 | tail -n 3 | tee -a "$out/train.log"
  ;;
scaling)
  timeout 60 "$py" benchmarks/gpu_profile.py --model vit_b16 --batches 1 64 256 2>&1 | tee "$out/profile.log"
  timeout 200 "$py" benchmarks/scaling.py --device cuda --dtype bf16 --models vit_b16 vit_l16 --batches 64 --train-batch 32 \
    --seconds 1.0 --json "$out/scaling.json" 2>&1 | tee "$out/scaling.log"
  timeout 290 "$py" benchmarks/peers.py --device cuda --compile --peers timm --rounds 3 --seconds 1.5 --batch-infer 256 \
    --batch-train 64 --cases vit_b16:infer:bf16 vit_b16:train:bf16 --json "$out/peers_compiled.json" \
    2>&1 | grep -v "model shards" | tee "$out/peers_compiled.log"
  timeout 150 "$py" benchmarks/peers.py --device cuda --lowp-stream --rounds 5 --seconds 3 --batch-train 128 \
    --cases vit_b16:train:bf16 --json "$out/peers_b16_train_b128.json" 2>&1 | grep -v "model shards" | tee "$out/peers_b16_train_b128.log"
  ;;
strategies)
  timeout 280 "$py" benchmarks/train_step.py --device cuda --precision bf16 --models vit_b16 --batch 64 --checkpointing off \
    --steps 20 --rounds 3 --json "$out/train_step_b16.json" 2>&1 | tee "$out/train_step_b16.log"
  timeout 300 "$py" benchmarks/train_step.py --device cuda --precision bf16 --models vit_l16 vit_h14 --batch 32 \
    --variants plain fsdp --steps 10 --rounds 2 --json "$out/train_step_l16_h14.json" 2>&1 | tee "$out/train_step_l16_h14.log"
  ;;
*) echo "usage: $0 peers|scaling|strategies" >&2; exit 2 ;;
esac
