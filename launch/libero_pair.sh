#!/usr/bin/env bash
# Both rejection-sampling variants of launch/libero_chain.sh side by side on a two-GPU box, from
# the same demos, SFT checkpoint and protocol-before sweep: the first chain (VARIANT_A, default
# rs_expert) on GPU 0 makes the shared stages and runs its RL; the second (VARIANT_B, default rs)
# waits for the protocol-before report, then runs its RL on GPU 1 with its own ports, so both RL
# runs and both protocol-after sweeps run at the same time, at equal load: each chain's actors
# render on the other chain's GPU (RENDER_A=1, RENDER_B=0: EGL device numbers), so each GPU holds
# one learner and one chain's rendering. Every other setting is
# libero_chain.sh's (environment variables, read by both chains); TAG_A / TAG_B name the two RL
# runs (default: their variants; two runs of one variant need two tags), and SET_A / SET_B hold
# settings for one chain only, as VAR=value words (e.g. SET_B="EXPERT_EPISODES=40").
# Run it in the background:
#
#   setsid launch/libero_pair.sh > /tmp/lr/pair.log 2>&1 &
#
# Logs: $R/chain_<tag>.log; results in $R/res/ as libero_chain.sh writes them.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/lr}; export R; mkdir -p "$R/res"
A=${VARIANT_A:-rs_expert}; B=${VARIANT_B:-rs}
TA=${TAG_A:-$A}; TB=${TAG_B:-$B}
[ "$TA" != "$TB" ] || { echo "both chains would write $R/$TA: set TAG_A and TAG_B apart" >&2; exit 2; }
env ${SET_A:-} TANDEM_LEARNER_GPU=0 TANDEM_RENDER_GPU=${RENDER_A:-1} VARIANT=$A TAG=$TA \
  bash launch/libero_chain.sh > "$R/chain_$TA.log" 2>&1 &
PA=$!
for _ in $(seq 1 3600); do
  [ -f "$R/before/eval_report.json" ] && break
  kill -0 $PA 2>/dev/null || { echo "chain $TA ended before the protocol-before sweep" >&2; exit 1; }
  sleep 2
done
env ${SET_B:-} TANDEM_LEARNER_GPU=1 TANDEM_RENDER_GPU=${RENDER_B:-0} VARIANT=$B TAG=$TB GPU_LOG=0 \
  EXTRA_ENV="${EXTRA_ENV:-} transport.port=${PORT_B:-5688} transport.pub_port=$((${PORT_B:-5688} + 1))" \
  bash launch/libero_chain.sh > "$R/chain_$TB.log" 2>&1 &
PB=$!
wait $PA; wait $PB
echo "both chains done: $(ls "$R"/res/eval_after_*.json 2>/dev/null | tr '\n' ' ')"
