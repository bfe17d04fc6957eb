#!/usr/bin/env bash
# Start the learner (GPU box).
#   launch/run_learner.sh [--host 0.0.0.0] [--port 5588] [--pub-port 5589] [hydra overrides...]
# e.g. launch/run_learner.sh algo=sac policy=mlp env=reacher run_dir=runs/exp1
# Binding a non-loopback host needs CURVE keys (tools/gen_keys.py) or
# transport.security.allow_insecure=true.
set -euo pipefail
source "$(dirname "$0")/common.sh"
exec "${PY[@]}" -m learner "${TANDEM_ARGS[@]}"
