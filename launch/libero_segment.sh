#!/usr/bin/env bash
# LIBERO RL in segments, each of which fits one call of a lent GPU box (10 minutes), so that a
# box lost between calls loses no progress: the state between segments is the policy alone,
# brought back to the driving machine in parts and carried up again.
#
#   launch/libero_segment.sh rl     # SEG=k: RL from START, then its policy packed into $OUT
#   launch/libero_segment.sh eval   # LIBERO's protocol (500 episodes) on START, report in $OUT
#
# START is the policy to begin from: a policy checkpoint folder (segment 1: the SFT checkpoint,
# $R/sft), or a folder holding the parts `policy.tgz.part*` that an earlier segment wrote (they
# are unpacked into $R/start_<checksum>). BASE, if set, is a folder holding `base.tgz.part*` (the
# demos and the protocol-before report), unpacked into $R when $R/demos is missing (a fresh box).
#
# `rl` runs launch/libero_chain.sh with TAG=seg<SEG>, START_CKPT=START, RS_S (seconds of RL,
# default 420), AFTER=0 and the actors named seg<SEG>-<i> (each id has its own reset seeds, so
# every segment and every actor plays other start states); then exports the run's last
# checkpoint as a policy folder (python -m tools.export --format lerobot: also a Tandem
# policy.checkpoint), packs it as $OUT/policy.tgz.partNN (at most 15 MiB each) and copies the
# run's metrics and status to $OUT, its logs as $OUT/seg<SEG>_logs.tgz. A new segment starts a new learner from that policy:
# the optimizer, the replay of earlier segments and the counters are not carried; the demos
# are mixed in every segment. `eval` runs the chain with RL=0 (TAG=eval<SEG>): the protocol
# sweeps START and its report goes to $OUT/eval_<SEG>.json. Every other setting is
# libero_chain.sh's (environment variables: VARIANT, N, N_RL, CYCLE_STEPS, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/lr}; export R; mkdir -p "$R/res"
SEG=${SEG:?set SEG (the segment number)}; OUT=${OUT:-$R/out}; mkdir -p "$OUT"
eval "$(bash launch/gpu_box.sh env)"   # the kit on PYTHONPATH (the export runs here too)
PY=${TANDEM_PYTHON:-python3}
mode=${1:?rl or eval}

if [ -n "${BASE:-}" ] && [ ! -f "$R/demos/meta/info.json" ]; then
  cat "$BASE"/base.tgz.part* | tar -xz -C "$R" || { echo "segment: cannot unpack $BASE/base.tgz.part*" >&2; exit 2; }
fi
START=${START:-$R/sft}
if ls "$START"/policy.tgz.part* > /dev/null 2>&1; then
  # unpacked once per distinct set of parts (named by their checksum, not by SEG: the same box
  # may run segment k from one policy and then the protocol on another)
  key=$(cat "$START"/policy.tgz.part* | md5sum | cut -c1-12); into="$R/start_$key"
  if [ ! -f "$into/model.safetensors" ]; then
    rm -rf "$into"; mkdir -p "$into"
    cat "$START"/policy.tgz.part* | tar -xz -C "$into" \
      || { echo "segment: cannot unpack $START/policy.tgz.part*" >&2; exit 2; }
  fi
  START="$into"
fi
[ -f "$START/model.safetensors" ] || { echo "segment: $START holds no policy (model.safetensors)" >&2; exit 2; }

case "$mode" in
  rl)
    TAG="seg$SEG" START_CKPT="$START" RS_S="${RS_S:-420}" AFTER=0 TANDEM_ACTOR_PREFIX="seg$SEG" \
      bash launch/libero_chain.sh || exit $?
    V="$R/seg$SEG"
    "$PY" -m tools.export --checkpoint "$V" --format lerobot --out "$R/policy_$SEG" --overwrite \
      env=libero_spatial env.image_size=64 policy=pi0_small "policy.checkpoint=$START" ${EXTRA_POL:-} \
      > "$R/res/export_seg$SEG.log" 2>&1 || { tail -n 20 "$R/res/export_seg$SEG.log" >&2; exit 3; }
    tar -czf - -C "$R/policy_$SEG" . | split -b 15M -d -a 2 - "$OUT/policy.tgz.part"
    for f in "seg${SEG}_metrics.jsonl" "seg${SEG}_status.json"; do
      [ -f "$R/res/$f" ] && cp "$R/res/$f" "$OUT/"
    done
    # the logs in one file: a lent box returns at most 8 files a call, the parts included
    logs=(); for f in "seg${SEG}_learner.log" "seg${SEG}_actors.txt" "export_seg$SEG.log" timeline.txt; do
      [ -f "$R/res/$f" ] && logs+=("$f")
    done
    [ ${#logs[@]} -gt 0 ] && tar -czf "$OUT/seg${SEG}_logs.tgz" -C "$R/res" "${logs[@]}"
    echo "segment $SEG: $(ls "$OUT"/policy.tgz.part* | wc -l) part(s) of the policy in $OUT" ;;
  eval)
    TAG="eval$SEG" START_CKPT="$START" RL=0 bash launch/libero_chain.sh || exit $?
    cp "$R/res/eval_after_eval$SEG.json" "$OUT/eval_$SEG.json"
    echo "segment $SEG: protocol $(grep -o '"success": [0-9.]*' "$OUT/eval_$SEG.json" | head -1)" ;;
  *) echo "segment: the mode is rl or eval, got $mode" >&2; exit 2 ;;
esac
