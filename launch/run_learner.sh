#!/usr/bin/env bash
# Start the learner (GPU box).
#   launch/run_learner.sh [--gpus N] [--cpu] [--host 0.0.0.0] [--port 5588] [--pub-port 5589] [hydra overrides...]
# e.g. launch/run_learner.sh algo=sac policy=mlp env=reacher run_dir=runs/exp1
#      launch/run_learner.sh --gpus 2 deepspeed.stage=2 algo=ppo policy=pi0 ...
# --gpus N (or the override gpus=N): N learner ranks, rank 0 owns the network, every rank
# trains (learner/distributed.py). N=1 runs exactly one process as before. N>1 starts them
# with `accelerate launch --multi_gpu`, plus DeepSpeed ZeRO (config/deepspeed/zero<S>.json)
# when deepspeed.stage=S is 2 or 3; --cpu (or device=cpu) starts N CPU processes (gloo)
# with torchrun instead, to try the multi-rank learner without GPUs.
# Binding a non-loopback host needs CURVE keys (tools/gen_keys.py) or
# transport.security.allow_insecure=true.
set -euo pipefail
source "$(dirname "$0")/common.sh"
GPUS="${TANDEM_GPUS:-1}"
CPU=0
STAGE=0
DEVICE_SET=0
for a in "${TANDEM_ARGS[@]}"; do
  case "$a" in
    gpus=*) GPUS="${a#gpus=}" ;;
    deepspeed.stage=*) STAGE="${a#deepspeed.stage=}" ;;
    device=cpu) CPU=1; DEVICE_SET=1 ;;
    device=*) DEVICE_SET=1 ;;
    --cpu) CPU=1 ;;
  esac
done
ARGS=()
for a in "${TANDEM_ARGS[@]}"; do
  case "$a" in
    --cpu) ;;
    gpus=*) ;;
    *) ARGS+=("$a") ;;
  esac
done
if ! [[ "$GPUS" =~ ^[1-9][0-9]*$ ]]; then
  echo "--gpus must be a positive integer, got '$GPUS'" >&2
  exit 2
fi
if [ "$GPUS" = 1 ]; then
  exec "${PY[@]}" -m learner "${ARGS[@]}" gpus=1
fi
PORT="${TANDEM_RDZV_PORT:-29500}"
if [ "$CPU" = 1 ]; then
  [ "$STAGE" = 0 ] || { echo "deepspeed.stage=$STAGE needs CUDA; drop it with --cpu" >&2; exit 2; }
  [ "$DEVICE_SET" = 1 ] || ARGS+=(device=cpu)
  exec "${PY[@]}" -m torch.distributed.run --nnodes 1 --nproc_per_node "$GPUS" \
    --master_addr 127.0.0.1 --master_port "$PORT" -m learner "${ARGS[@]}" gpus="$GPUS"
fi
LAUNCH=("${PY[@]}" -m accelerate.commands.launch --num_processes "$GPUS" --num_machines 1
        --main_process_port "$PORT" --mixed_precision no --dynamo_backend no)
case "$STAGE" in
  0) LAUNCH+=(--multi_gpu) ;;
  2|3) LAUNCH+=(--use_deepspeed --deepspeed_config_file "config/deepspeed/zero$STAGE.json") ;;
  *) echo "deepspeed.stage must be 0 (DDP), 2 or 3, got '$STAGE'" >&2; exit 2 ;;
esac
exec "${LAUNCH[@]}" -m learner "${ARGS[@]}" gpus="$GPUS"
