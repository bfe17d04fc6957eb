#!/usr/bin/env bash
# The embedded default job: a learner and 2 actors on this machine, SAC + MLP policy on the
# MuJoCo Reacher arm (state observations). It stops by itself once the success rate over the
# last 20 episodes reaches 0.8 (fingertip within 5 cm of the target at the episode's end).
#   launch/demo.sh [more overrides, e.g. learner:trainer.stop_at_success=0.9]
set -euo pipefail
exec "$(dirname "$0")/run_local.sh" --actors "${TANDEM_ACTORS:-2}" \
  run_dir="${TANDEM_RUN_DIR:-runs/demo}" learner:trainer.stop_at_success=0.8 "$@"
