#!/usr/bin/env bash
# Learner and N actors in split tmux panes on one machine.
#   launch/tmux.sh [--actors N] [hydra overrides for both...]
# Ctrl-C in a pane stops that process; `tmux kill-session -t tandem` stops everything.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
N=1
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --actors) N="$2"; shift 2 ;;
    *) ARGS+=("$(printf '%q' "$1")"); shift ;;
  esac
done
command -v tmux >/dev/null || { echo "tmux not found: use launch/run_local.sh instead" >&2; exit 1; }
SESSION="${TANDEM_TMUX_SESSION:-tandem}"
tmux new-session -d -s "$SESSION" "$ROOT/launch/run_learner.sh ${ARGS[*]:-}; read -p 'learner exited; Enter to close'"
for i in $(seq 0 $((N - 1))); do
  tmux split-window -t "$SESSION" -v "sleep 3; $ROOT/launch/run_actor.sh actor_id=actor-$i seed=$((i * 1000)) ${ARGS[*]:-}; read -p 'actor exited; Enter to close'"
done
tmux select-layout -t "$SESSION" even-vertical
exec tmux attach -t "$SESSION"
