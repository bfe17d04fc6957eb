#!/usr/bin/env bash
# The one-GPU LIBERO RL run against two ways of using a second GPU, on a two-GPU box, one arm
# after another, each from the same demos and SFT checkpoint with the same actors and settings
# (issue 30, run 2; docs/libero.md, "Two GPUs: the arms script"):
#
#   one  everything on GPU 0: the learner sees GPU 0 alone (libero_chain.sh's RL as on one GPU)
#   a    training on GPU 0, serving on GPU 1 (inference.device=cuda:1)
#   b    DeepSpeed ZeRO-2 training on both GPUs (gpus=2 deepspeed.stage=2, float32 like the
#        others: config/deepspeed/zero2_fp32.json), serving on GPU 0 (rank 0's)
#
# Install the kit first (launch/gpu_box.sh install, once per part), then, in the background:
#
#   setsid launch/libero_two_gpu.sh > /tmp/lr/arms.log 2>&1 < /dev/null &
#
# It checks the kit (exit 3 without it), makes the demos and the SFT checkpoint with
# launch/libero_chain.sh's first stages (or reuses those in $R), runs each arm's RL for RS_S
# seconds through libero_chain.sh (TAG=<arm>: its run in $R/<arm>, its files in $R/res as
# <arm>_metrics.jsonl, <arm>_status.json, <arm>_gpu.csv, <arm>_actor_lines.txt, ...), and at the
# end writes the comparison with tools/libero_arms.py: $R/res/arms.json and $R/res/arms.md.
# $R/res/arms_done holds each arm's exit code. An arm whose metrics exist is skipped, so a rerun
# goes on where one stopped.
#
# Settings (environment variables; defaults in brackets): ARMS (the arms, in order, "one a b"),
# RS_S (seconds of RL per arm, 240), AFTER (1: LIBERO's protocol after each arm, about 4.5 min
# each; 0), BEFORE (1: the protocol on the SFT checkpoint first; 0), RENDER_GPU (the EGL device
# every arm's actors render on, 0: as on one GPU), LRN_ONE / LRN_A / LRN_B (each arm's learner
# overrides; the defaults above: "", "inference.device=cuda:1", "gpus=2 deepspeed.stage=2
# deepspeed.config=config/deepspeed/zero2_fp32.json"), GPU_ONE (the one GPU arm one's learner
# sees, 0; empty: all), ARMS_PY (the Python of the comparison, python3). Every other setting is
# libero_chain.sh's, with the one-GPU run's values as defaults here (docs/libero.md, the one-hold
# run): VARIANT=rs_expert K=2 STEPS=2000 N=16 N_RL=12 BATCH=256 CYCLE_STEPS=1000 CYCLE_SFT=100
# CKPT_S=300 DRIFT_STEPS=4 DRIFT=0.8 WORKERS=10 TANDEM_ACTOR_NICE=10, and EXPERT_EPISODES=6 (the
# expert watches each actor's first 6 episodes: in a 240-s arm its corrections end well before
# the arm does, as they did in the 900-s run with 25; time to the target is read after them).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/lr}; export R; mkdir -p "$R/res"
export VARIANT=${VARIANT:-rs_expert} K=${K:-2} STEPS=${STEPS:-2000} N=${N:-16} N_RL=${N_RL:-12}
export BATCH=${BATCH:-256} CYCLE_STEPS=${CYCLE_STEPS:-1000} CYCLE_SFT=${CYCLE_SFT:-100} CKPT_S=${CKPT_S:-300}
export EXPERT_EPISODES=${EXPERT_EPISODES:-6} DRIFT_STEPS=${DRIFT_STEPS:-4} DRIFT=${DRIFT:-0.8}
export WORKERS=${WORKERS:-10} TANDEM_ACTOR_NICE=${TANDEM_ACTOR_NICE:-10}
RS_S=${RS_S:-240}; ARMS=${ARMS:-one a b}
LRN_ONE=${LRN_ONE-}
LRN_A=${LRN_A-inference.device=cuda:1}
LRN_B=${LRN_B-gpus=2 deepspeed.stage=2 deepspeed.config=config/deepspeed/zero2_fp32.json}
GPU_ONE=${GPU_ONE-0}
log() { echo "[$(date +%T)] arms: $*" | tee -a "$R/res/timeline.txt"; }

for arm in $ARMS; do
  case "$arm" in one|a|b) ;; *) echo "arms: ARMS holds one, a and b; got '$arm'" >&2; exit 2 ;; esac
done
if (( BATCH % 2 )) && [[ " $ARMS " == *" b "* ]]; then
  echo "arms: BATCH=$BATCH does not split over arm b's 2 ranks: make it even" >&2; exit 2
fi
# the kit first (a box that went back and came fresh has none)
bash launch/gpu_box.sh check || { echo "arms: the kit check failed (launch/gpu_box.sh install)" >&2; exit 3; }

log "demos and SFT (reused when $R holds them)"
BEFORE=0 RL=0 AFTER=0 bash launch/libero_chain.sh > "$R/chain_prep.log" 2>&1
[ -f "$R/sft/model.safetensors" ] || { echo "arms: no SFT checkpoint ($R/chain_prep.log)" >&2
                                       tail -n 20 "$R/chain_prep.log" >&2; exit 1; }
: > "$R/res/arms_done"
for arm in $ARMS; do
  case "$arm" in
    one) lrn=$LRN_ONE; pin=$GPU_ONE ;;
    a) lrn=$LRN_A; pin="" ;;
    b) lrn=$LRN_B; pin="" ;;
  esac
  log "arm $arm: $RS_S s of $VARIANT, learner overrides '${lrn}', learner GPUs ${pin:-all}, actors render on GPU ${RENDER_GPU:-0}"
  # the arm's overrides go to its RL learner alone (the protocol's sweeps run on one GPU: an
  # evaluation refuses gpus=2)
  env TAG="$arm" RS_S="$RS_S" BEFORE="${BEFORE:-0}" AFTER="${AFTER:-0}" RL_EXTRA="$lrn" \
    GPU_CSV="$R/res/${arm}_gpu.csv" TANDEM_LEARNER_GPU="$pin" TANDEM_RENDER_GPU="${RENDER_GPU:-0}" \
    bash launch/libero_chain.sh > "$R/chain_$arm.log" 2>&1
  rc=$?
  echo "$arm=$rc" >> "$R/res/arms_done"
  log "arm $arm: exit $rc; $(ls "$R/res/${arm}_metrics.jsonl" 2>/dev/null || echo 'no metrics')"
done
ARMS_PY=${ARMS_PY:-python3}
"$ARMS_PY" -m tools.libero_arms --res "$R/res" --arms $ARMS --out "$R/res/arms" > "$R/res/arms_compare.log" 2>&1 \
  || { echo "arms: the comparison failed ($R/res/arms_compare.log)" >&2; tail -n 20 "$R/res/arms_compare.log" >&2; }
log "done: $(tr '\n' ' ' < "$R/res/arms_done")"
! grep -qv "=0$" "$R/res/arms_done"
