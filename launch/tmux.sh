#!/usr/bin/env bash
# Learner and N actors in split tmux panes on one machine, each with its live status view
# (the learner's per-actor table on top, one panel per actor below).
#   launch/tmux.sh [--actors N] [hydra overrides for both...]
# Overrides starting with "learner:" go to the learner only, "actor:" to the actors only:
#   launch/tmux.sh --actors 2 env=point_reach actor:intervention.device=keyboard
# Ctrl-C in a pane stops that process; `tmux kill-session -t tandem` stops everything.
# TANDEM_TMUX_SESSION names the session; TANDEM_TMUX_SOCKET runs it on its own tmux server
# (tmux -L); TANDEM_TMUX_NO_ATTACH=1 starts it detached (scripts, tests).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
N=1
COMMON=(); LEARNER=(); ACTOR=()
while [ $# -gt 0 ]; do
  case "$1" in
    --actors) N="$2"; shift 2 ;;
    learner:*) LEARNER+=("$(printf '%q' "${1#learner:}")"); shift ;;
    actor:*) ACTOR+=("$(printf '%q' "${1#actor:}")"); shift ;;
    *) COMMON+=("$(printf '%q' "$1")"); shift ;;
  esac
done
command -v tmux >/dev/null || { echo "tmux not found: use launch/run_local.sh instead" >&2; exit 1; }
SESSION="${TANDEM_TMUX_SESSION:-tandem}"
# the panes have their own size: a COLUMNS/LINES exported by the calling terminal (or a test
# runner: pytest-xdist's workers get 80x24) would make rich draw every pane at that width
unset COLUMNS LINES
TMUX_CMD=(tmux)
[ -n "${TANDEM_TMUX_SOCKET:-}" ] && TMUX_CMD=(tmux -L "$TANDEM_TMUX_SOCKET")
"${TMUX_CMD[@]}" new-session -d -s "$SESSION" -x "${TANDEM_TMUX_WIDTH:-200}" -y "${TANDEM_TMUX_HEIGHT:-60}" \
  "$ROOT/launch/run_learner.sh ${COMMON[*]:-} ${LEARNER[*]:-}; read -p 'learner exited; Enter to close'"
for i in $(seq 0 $((N - 1))); do
  "${TMUX_CMD[@]}" split-window -t "$SESSION" -v "sleep 3; $ROOT/launch/run_actor.sh actor_id=actor-$i seed=$((i * 1000)) ${COMMON[*]:-} ${ACTOR[*]:-}; read -p 'actor exited; Enter to close'"
  "${TMUX_CMD[@]}" select-layout -t "$SESSION" even-vertical
done
# the learner's table gets half the window, the actors share the rest
"${TMUX_CMD[@]}" resize-pane -t "$SESSION:0.0" -y "$(( ${TANDEM_TMUX_HEIGHT:-60} / 2 ))" 2>/dev/null || true
[ -n "${TANDEM_TMUX_NO_ATTACH:-}" ] && { echo "tmux session $SESSION started"; exit 0; }
exec "${TMUX_CMD[@]}" attach -t "$SESSION"
