#!/usr/bin/env bash
# The embedded default job: a learner and 2 actors on this machine, SAC + MLP policy on the
# MuJoCo cart-pole (config/env/inverted_pendulum.yaml, the default env of config/learner.yaml
# and config/actor.yaml; state observations, 1-D force action). It stops by itself once the
# success rate over the last 20 episodes reaches 0.8 (the pole kept up for the whole
# 100-step episode).
#   launch/demo.sh [more overrides, e.g. learner:trainer.stop_at_success=0.9]
# At the end it plots the run (tools/plot_run.py) and prints the PNG's path.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RUN_DIR="${TANDEM_RUN_DIR:-runs/demo}"
"$ROOT/launch/run_local.sh" --actors "${TANDEM_ACTORS:-2}" \
  run_dir="$RUN_DIR" learner:trainer.stop_at_success=0.8 "$@"
status=$?
PY="${TANDEM_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
if [ -f "$RUN_DIR/metrics.jsonl" ] || [ -f "$ROOT/$RUN_DIR/metrics.jsonl" ]; then
  (cd "$ROOT" && plot="$("$PY" -m tools.plot_run "$RUN_DIR" 2>/dev/null | tail -1)" \
    && echo "plot of this run: $plot")
fi
exit $status
