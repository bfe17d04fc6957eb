#!/usr/bin/env bash
# Start an actor (robot / sim box) against a learner.
#   launch/run_actor.sh [--host LEARNER_HOST] [--port 5588] [--pub-port 5589] [hydra overrides...]
# e.g. launch/run_actor.sh --host 10.0.0.5 actor_id=arm-1 env=reacher mode=remote
set -euo pipefail
source "$(dirname "$0")/common.sh"
exec "${PY[@]}" -m actor "${TANDEM_ARGS[@]}"
