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
  # TERM, not INT: background jobs of a script start with SIGINT ignored
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  sleep 0.2  # let the output filters drain
}
trap cleanup INT TERM EXIT
# process substitution (not a pipe) so that $! is the Python process, not sed
"$ROOT/launch/run_learner.sh" "${COMMON[@]}" "${LEARNER[@]}" > >(trap '' INT; exec sed -u 's/^/[learner] /') 2>&1 &
learner_pid=$!
pids+=($learner_pid)
for i in $(seq 0 $((N - 1))); do
  "$ROOT/launch/run_actor.sh" actor_id="actor-$i" seed=$((i * 1000)) "${COMMON[@]}" "${ACTOR[@]}" \
    > >(trap '' INT; exec sed -u "s/^/[actor-$i] /") 2>&1 &
  pids+=($!)
done
# The learner ends the run (stop_at_success / max_updates / eval done); then stop the actors.
wait "$learner_pid"
status=$?
cleanup
exit $status
