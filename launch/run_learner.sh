#!/usr/bin/env bash
# Start the learner (GPU box).
#   launch/run_learner.sh [--gpus N] [--cpu] [--host 0.0.0.0] [--port 5588] [--pub-port 5589]
#                         [--nodes M --node-rank R --main-addr HOST [--main-port 29500]] [hydra overrides...]
# e.g. launch/run_learner.sh algo=sac policy=mlp env=reacher run_dir=runs/exp1
#      launch/run_learner.sh --gpus 2 deepspeed.stage=2 algo=ppo policy=pi0 ...
# --gpus N (or the override gpus=N): N learner ranks, rank 0 owns the network, every rank
# trains (learner/distributed.py). N=1 runs exactly one process as before. N>1 starts them
# with `accelerate launch --multi_gpu`, plus DeepSpeed ZeRO (config/deepspeed/zero<S>.json)
# when deepspeed.stage=S is 2 or 3 (deepspeed.config=FILE: another DeepSpeed config of that stage,
# e.g. config/deepspeed/zero2_fp32.json); --cpu (or device=cpu) starts N CPU processes (gloo)
# with torchrun instead, to try the multi-rank learner without GPUs.
# Several hosts: the same command on each, with --nodes M (hosts), --node-rank R (0..M-1; rank
# 0 of node 0 owns the network), --main-addr (node 0's address, reachable from the others) and
# --main-port (its rendezvous port, default TANDEM_RDZV_PORT or 29500); --gpus is per node.
# run_dir must be the same folder on every host (a shared filesystem): checkpoints are written
# by every rank and loaded by every rank; a learner whose ranks do not see it stops at start.
# Binding a non-loopback host needs CURVE keys (tools/gen_keys.py) or
# transport.security.allow_insecure=true.
set -euo pipefail
source "$(dirname "$0")/common.sh"
GPUS="${TANDEM_GPUS:-1}"
CPU=0
STAGE=0
DS_CONFIG=""
DEVICE_SET=0
for a in "${TANDEM_ARGS[@]}"; do
  case "$a" in
    gpus=*) GPUS="${a#gpus=}" ;;
    deepspeed.stage=*) STAGE="${a#deepspeed.stage=}" ;;
    deepspeed.config=*) DS_CONFIG="${a#deepspeed.config=}" ;;
    device=cpu) CPU=1; DEVICE_SET=1 ;;
    device=*) DEVICE_SET=1 ;;
    --cpu) CPU=1 ;;
  esac
done
NODES=1
NODE_RANK=0
ADDR=127.0.0.1
PORT="${TANDEM_RDZV_PORT:-29500}"
ARGS=()
set -- "${TANDEM_ARGS[@]}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu|gpus=*) shift ;;
    --nodes) NODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --main-addr) ADDR="$2"; shift 2 ;;
    --main-port) PORT="$2"; shift 2 ;;
    nodes=*) NODES="${1#nodes=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "--gpus must be a positive integer, got '$GPUS'" >&2; exit 2; }
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || { echo "--nodes must be a positive integer, got '$NODES'" >&2; exit 2; }
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NODES" ] || {
  echo "--node-rank must be 0..$((NODES - 1)) for --nodes $NODES, got '$NODE_RANK'" >&2; exit 2; }
if [ "$GPUS" = 1 ] && [ "$NODES" = 1 ]; then
  exec "${PY[@]}" -m learner "${ARGS[@]}" gpus=1
fi
if [ "$NODES" -gt 1 ] && [ "$ADDR" = 127.0.0.1 ]; then
  echo "note: --main-addr is 127.0.0.1: every node must run on this host (pass node 0's address)" >&2
fi
if [ "$CPU" = 1 ]; then
  [ "$STAGE" = 0 ] || { echo "deepspeed.stage=$STAGE needs CUDA; drop it with --cpu" >&2; exit 2; }
  [ "$DEVICE_SET" = 1 ] || ARGS+=(device=cpu)
  exec "${PY[@]}" -m torch.distributed.run --nnodes "$NODES" --node_rank "$NODE_RANK" \
    --nproc_per_node "$GPUS" --master_addr "$ADDR" --master_port "$PORT" \
    -m learner "${ARGS[@]}" gpus="$GPUS" nodes="$NODES"
fi
LAUNCH=("${PY[@]}" -m accelerate.commands.launch --num_processes "$((GPUS * NODES))"
        --num_machines "$NODES" --machine_rank "$NODE_RANK" --main_process_ip "$ADDR"
        --main_process_port "$PORT" --mixed_precision no --dynamo_backend no)
case "$STAGE" in
  0) LAUNCH+=(--multi_gpu) ;;
  2|3) DS_CONFIG="${DS_CONFIG:-config/deepspeed/zero$STAGE.json}"
       [ -f "$DS_CONFIG" ] || { echo "deepspeed.config=$DS_CONFIG: no such file" >&2; exit 2; }
       LAUNCH+=(--use_deepspeed --deepspeed_config_file "$DS_CONFIG") ;;
  *) echo "deepspeed.stage must be 0 (DDP), 2 or 3, got '$STAGE'" >&2; exit 2 ;;
esac
exec "${LAUNCH[@]}" -m learner "${ARGS[@]}" gpus="$GPUS" nodes="$NODES"
