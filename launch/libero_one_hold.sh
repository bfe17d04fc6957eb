#!/usr/bin/env bash
# The whole LIBERO chain in one hold of one GPU box, with the RL run overlapping the
# protocol-before sweep: demos -> SFT, then at once (a) LIBERO's protocol on the SFT checkpoint
# (its own learner, on other ports) and (b) the RL run from the same checkpoint, then (b)'s
# protocol after. A box is held at most 30 minutes and the two sweeps take about 10 of them;
# overlapping the first sweep with the RL gives the RL about 5 more minutes. The protocol's
# result does not depend on the load (fixed init states, the flow integrated from zero noise);
# the RL's first minutes run on a busier box (the sweep's actors share the cores).
#
#   setsid launch/libero_one_hold.sh > /tmp/lr/hold.log 2>&1 &
#
# Every setting is launch/libero_chain.sh's (environment variables, read by both chains);
# PORT_BEFORE (5688) is the protocol-before learner's port (and +1 its publisher's). Results in
# $R/res/ as libero_chain.sh writes them: eval_before.json, eval_after_<TAG>.json,
# <TAG>_metrics.jsonl, <TAG>_status.json; $R/res/hold_done holds the exit codes at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/lr}; export R; mkdir -p "$R/res"
TAG=${TAG:-${VARIANT:-rs}}
# the kit first (a box that went back and came fresh has none): stop at once, not after the stages fail
bash launch/gpu_box.sh check || { echo "hold: the kit check failed (launch/gpu_box.sh install)" >&2; exit 3; }
# demos and SFT (the chain's first stages; no sweep, no RL)
BEFORE=0 RL=0 AFTER=0 bash launch/libero_chain.sh > "$R/chain_prep.log" 2>&1
[ -f "$R/sft/model.safetensors" ] || { echo "hold: no SFT checkpoint ($R/chain_prep.log)" >&2; tail -n 20 "$R/chain_prep.log" >&2; exit 1; }
P=${PORT_BEFORE:-5688}
BEFORE=1 RL=0 AFTER=0 GPU_LOG=0 EXTRA_ENV="${EXTRA_ENV:-} transport.port=$P transport.pub_port=$((P + 1))" \
  bash launch/libero_chain.sh > "$R/chain_before.log" 2>&1 &
PA=$!
BEFORE=0 bash launch/libero_chain.sh > "$R/chain_$TAG.log" 2>&1 &
PB=$!
wait $PA; RA=$?; wait $PB; RB=$?
echo "before=$RA rl=$RB" > "$R/res/hold_done"
echo "hold done: before=$RA rl=$RB; $(ls "$R"/res/eval_*.json 2>/dev/null | tr '\n' ' ')"
[ "$RA" = 0 ] && [ "$RB" = 0 ]
