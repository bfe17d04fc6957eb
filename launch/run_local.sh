#!/usr/bin/env bash
# Learner + N actors on this machine in the foreground (no tmux needed). Ctrl-C stops all.
#   launch/run_local.sh [--actors N] [hydra overrides for both...]
# Overrides starting with "learner:" go to the learner only, "actor:" to the actors only:
#   launch/run_local.sh --actors 2 env=reacher learner:trainer.max_updates=5000
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
N=1
COMMON=(); LEARNER=(); ACTOR=()
while [ $# -gt 0 ]; do
  case "$1" in
    --actors) N="$2"; shift 2 ;;
    learner:*) LEARNER+=("${1#learner:}"); shift ;;
    actor:*) ACTOR+=("${1#actor:}"); shift ;;
    *) COMMON+=("$1"); shift ;;
  esac
done
pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
}
trap cleanup INT TERM EXIT
"$ROOT/launch/run_learner.sh" "${COMMON[@]}" "${LEARNER[@]}" 2>&1 | sed -u 's/^/[learner] /' &
pids+=($!)
learner_pid=$!
for i in $(seq 0 $((N - 1))); do
  "$ROOT/launch/run_actor.sh" actor_id="actor-$i" seed=$((i * 1000)) "${COMMON[@]}" "${ACTOR[@]}" 2>&1 \
    | sed -u "s/^/[actor-$i] /" &
  pids+=($!)
done
# The learner ends the run (stop_at_success / max_updates / eval done); then stop the actors.
wait "$learner_pid"
status=$?
cleanup
exit $status
