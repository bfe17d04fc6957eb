#!/usr/bin/env bash
# LIBERO for real on one GPU box, in order: scripted-expert demos -> SFT of a PI0 trained from
# scratch -> LIBERO's 500-episode protocol -> RL (rejection sampling, plain or expert-corrected,
# or Flow-Noise PPO) through the learner and N actors -> the protocol again (docs/libero.md has
# the figures of a run). Install the kit first (launch/gpu_box.sh install); run it in the
# background and read $R/res/ as it goes:
#
#   setsid launch/libero_chain.sh > /tmp/lr/chain.log 2>&1 &
#
# Settings (environment variables; defaults in brackets): R (work folder, /tmp/lr), K (demos per
# task, 10), STEPS (SFT steps, 2000), N (actors of the protocol sweeps, 14), N_BEFORE (actors of
# the protocol-before sweep, N), N_RL (actors of the RL run, N), RS_MIN (minutes of RL, 5),
# VARIANT (rs: plain rejection sampling | rs_expert: the scripted expert corrects the first
# EXPERT_EPISODES episodes of every RL actor, taking over after DRIFT_STEPS steps in a row farther
# than DRIFT from its own action | flow_ppo: Flow-Noise PPO, PPO_EPISODES episodes a round, lr
# PPO_LR), TAG (the RL run's name: its folder $R/$TAG and its files in $R/res; VARIANT), CYCLE_STEPS / CYCLE_SFT (rejection sampling: env steps that start a BC cycle / BC steps
# in it, 3000 / 300), BATCH (BC batch, 64; PPO's minibatch, 128), CKPT_S (seconds between the RL
# run's checkpoints, 60), WORKERS (demo recording processes, 10), SWEEP (the protocol, {task_ids:
# 10, init_states: 50}), TASKS (env.task_id, all), EXTRA_LRN (the learner's alone, e.g.
# inference.device=cuda:1 to serve on a second GPU), RL_EXTRA (the RL run's learner alone, not the
# sweeps': e.g. gpus=2 deepspeed.stage=2, which an evaluation refuses), EXTRA_ENV / EXTRA_POL (more overrides, e.g. a
# short time limit for a dry run on a CPU), CARRY (set: pack the RL run into $R/carry for the next
# machine, where tools/carry_run.py unpacks it into $R/$TAG and a rerun goes on from its
# checkpoint), GPU_LOG (0: no nvidia-smi log, for a second chain beside this one), START_CKPT (the
# policy the RL run and its protocol-after sweep start from; $R/sft), RS_S (seconds of RL, instead
# of RS_MIN), RL (0: no RL run: the protocol after sweeps START_CKPT itself), AFTER (0: no
# protocol-after sweep), BEFORE (0: no protocol-before sweep), GPU_CSV (the nvidia-smi log,
# $R/res/gpu.csv), IMAGE (the cameras' size, 64). launch/libero_segment.sh uses
# START_CKPT, RS_S, RL and AFTER to run RL in segments.
# Two variants side by side on a two-GPU box: the second chain waits for $R/before/eval_report.json,
# has its learners on GPU 1 (TANDEM_LEARNER_GPU=1, read by gpu_box.sh) with other ports
# (EXTRA_ENV="transport.port=5688 transport.pub_port=5689") and GPU_LOG=0: launch/libero_pair.sh.
# Every stage skips itself when its output exists, so a rerun continues where one stopped, and a
# second VARIANT reuses the demos, the SFT checkpoint and the protocol-before sweep.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/lr}; mkdir -p "$R/res"; PY=${TANDEM_PYTHON:-python3}
eval "$(bash launch/gpu_box.sh env)"
K=${K:-10}; STEPS=${STEPS:-2000}; RS_MIN=${RS_MIN:-5}; N=${N:-14}; N_RL=${N_RL:-$N}; N_BEFORE=${N_BEFORE:-$N}
VARIANT=${VARIANT:-rs}; TAG=${TAG:-$VARIANT}; V="$R/$TAG"
ENVB="env=libero_spatial env.task_id=${TASKS:-all} env.image_size=${IMAGE:-64}"
ENVO="$ENVB ${EXTRA_ENV:-}"
POL="policy=pi0_small ${EXTRA_POL:-}"
log() { echo "[$(date +%T)] $*" | tee -a "$R/res/timeline.txt"; }
gpu() { command -v nvidia-smi >/dev/null && [ "${GPU_LOG:-1}" != 0 ] || return 0
        while true; do nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader >> "${GPU_CSV:-$R/res/gpu.csv}"; sleep 5; done; }
gpu & GPUPID=$!
trap 'kill $GPUPID 2>/dev/null' EXIT

log "demos: $K per task from sampled placements (none of the evaluation states)"
[ -f "$R/demos/meta/info.json" ] || $PY -m tools.record_demos --out "$R/demos" --episodes "$K" --per-task \
  --only-success --seed 1000 --workers "${WORKERS:-10}" --max-tries $((2 * K)) $ENVB env.init_state_id=random \
  > "$R/demos.log" 2>&1
[ -f "$R/demos.log" ] && grep -a '^{' "$R/demos.log" | tail -1 > "$R/res/demos.json"

log "sft: $STEPS steps"
[ -f "$R/sft/model.safetensors" ] || [ -n "${START_CKPT:-}" ] || $PY -m tools.sft --demos "$R/demos" --save-checkpoint "$R/sft" --steps "$STEPS" \
  --batch-size 64 --lr 3e-4 --lr-min 3e-5 --warmup "${WARMUP:-200}" --threads 0 $ENVB $POL > "$R/sft.log" 2>&1
[ -f "$R/sft.log" ] && grep -a '^{' "$R/sft.log" | tail -1 > "$R/res/sft.json"

COMMON="$ENVO $POL policy.checkpoint=${START_CKPT:-$R/sft}"
LRN="algo=rejection_sampling logging.wandb=disabled ${EXTRA_LRN:-}"
ACT="chunk.execute=5"
sweep() {   # run_dir [actors]: LIBERO's protocol through the learner and N actors (the run_dir's checkpoint, if any)
  bash launch/gpu_box.sh start --actors "${2:-$N}" --run-dir "$1" $COMMON ${SWEEP_POL:-} $LRN mode=eval \
    "eval.sweep=${SWEEP:-{task_ids: 10, init_states: 50\}}" -- $COMMON ${SWEEP_POL:-} $ACT
  for _ in $(seq 1 1800); do [ -f "$1/eval_report.json" ] && break; sleep 2; done
  bash launch/gpu_box.sh stop --run-dir "$1"
}

if [ "${BEFORE:-1}" = 0 ]; then
  log "no protocol before (BEFORE=0: the protocol runs elsewhere, e.g. libero_segment.sh eval)"
else
  log "protocol before RL"
  [ -f "$R/before/eval_report.json" ] || sweep "$R/before" "$N_BEFORE"
  cp "$R/before/eval_report.json" "$R/res/eval_before.json"
fi

RL_ACT="$ACT env.init_state_id=random"
RL_POL=""   # policy overrides of the RL run and its protocol-after sweep (learner and actors)
case "$VARIANT" in
  rs|rs_expert)
    RL_LRN="$LRN buffer.demos=$R/demos algo.eval_episodes=0 algo.env_steps_per_cycle=${CYCLE_STEPS:-3000} \
      algo.sft_steps_per_cycle=${CYCLE_SFT:-300} algo.batch_size=${BATCH:-64} algo.lr=1e-4 algo.lr_min=1e-5"
    if [ "$VARIANT" = rs_expert ]; then   # HG-DAgger: the expert takes over where the policy drifts
      RL_ACT="$RL_ACT intervention.device=expert intervention.expert.episodes=${EXPERT_EPISODES:-10} \
        intervention.expert.drift_steps=${DRIFT_STEPS:-4} intervention.expert.drift_threshold=${DRIFT:-0.8}"
    fi ;;
  flow_ppo)   # Flow-Noise PPO (πRL): a learned noise std at every Euler step, GAE on the value head
    RL_POL="policy.flow_rl=noise"
    LRN="algo=ppo logging.wandb=disabled ${EXTRA_LRN:-}"
    RL_LRN="$LRN algo.batch_episodes=${PPO_EPISODES:-48} algo.min_batch_chunks=0 \
      algo.minibatch_size=${BATCH:-128} algo.epochs=2 algo.lr=${PPO_LR:-2e-5} algo.lr_warmup_updates=3 \
      algo.loss_agg=episode_mean algo.clip_high=0.28 algo.max_staleness=1" ;;
  *) echo "VARIANT must be rs, rs_expert or flow_ppo, got $VARIANT" >&2; exit 2 ;;
esac
RL_SECONDS=${RS_S:-$((RS_MIN * 60))}
[ "${RL:-1}" = 0 ] || log "$TAG ($VARIANT): $([ -n "${RS_S:-}" ] && echo "$RS_S s" || echo "$RS_MIN min") with $N_RL actors"
if [ "${RL:-1}" != 0 ] && [ ! -f "$R/res/${TAG}_metrics.jsonl" ]; then
  bash launch/gpu_box.sh start --actors "$N_RL" --run-dir "$V" $COMMON $RL_POL $RL_LRN ${RL_EXTRA:-} \
    trainer.checkpoint_every_s="${CKPT_S:-60}" -- $COMMON $RL_POL $RL_ACT
  sleep "$RL_SECONDS"
  bash launch/gpu_box.sh stop --run-dir "$V"
  cp "$V/metrics.jsonl" "$R/res/${TAG}_metrics.jsonl"; cp "$V/status.json" "$R/res/${TAG}_status.json"
  cp "$V/learner.log" "$R/res/${TAG}_learner.log"
  cat "$V"/actor-*.log | grep -a "takeover\|HOLDING" | tail -20 > "$R/res/${TAG}_actors.txt" || true
  # each actor's last progress line (its act round trip's p50 / p99 over the run)
  for f in "$V"/actor-*.log; do [ -f "$f" ] && { grep -a "act failures" "$f" | tail -1 || true; }; done \
    > "$R/res/${TAG}_actor_lines.txt"
  # the run in parts of <= 15 MiB, to carry it to the next machine (tools/carry_run.py unpack there)
  # (written aside, then renamed: a poll waiting for the file never reads it half-written)
  if [ -n "${CARRY:-}" ]; then
    $PY -m tools.carry_run pack "$V" "$R/carry" --part-mib 15 > "$R/res/.carry_${TAG}.json"
    mv "$R/res/.carry_${TAG}.json" "$R/res/carry_${TAG}.json"
  fi
fi

[ "${AFTER:-1}" = 0 ] && { log "$TAG: no protocol after (AFTER=0)"; exit 0; }
log "protocol after RL"
[ -f "$V/eval_report.json" ] || SWEEP_POL="$RL_POL" sweep "$V"
cp "$V/eval_report.json" "$R/res/.eval_after_${TAG}.json"
mv "$R/res/.eval_after_${TAG}.json" "$R/res/eval_after_${TAG}.json"
log done
