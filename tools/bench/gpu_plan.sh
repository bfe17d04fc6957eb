#!/usr/bin/env bash
# The one-GPU issue's measurements on a lent GPU box, in the order of what a device-minute buys,
# each stage in its own process with its own time limit, resumable: a stage whose .done marker
# is in OUT is skipped, so carrying OUT to the next box goes on where the last one stopped.
#
#   tools/bench/gpu_plan.sh start [OUT]      # in the background (setsid); returns at once
#   tools/bench/gpu_plan.sh run [OUT]        # in the foreground
#   tools/bench/gpu_plan.sh status [OUT]     # a line per stage: ok / failed rc / running / to do
#   tools/bench/gpu_plan.sh collect OUT DEST # OUT's JSONs, logs and markers into DEST (a run's $OUT)
#   tools/bench/gpu_plan.sh list             # the stages and their commands
#
# OUT defaults to runs/gpu_plan (git-ignored). STAGES picks and orders stages (default: all, as
# below); TANDEM_PY is the interpreter (default python3: the box's, with torch). Run it from the
# repository root after `launch/gpu_box.sh install` (the kit: wheels, LIBERO, its assets), so that
# `eval "$(launch/gpu_box.sh env)"` gives the paths; `start` does that itself.
#
# Stages (limit in s):
#   tests    (720)  the GPU tests of the fast paths: PI0's step layers, fused projections, levers; OFT's, FP8
#   gpu_new  (600)  the GPU tests of the newest paths only: PI0's prefix stages ahead of time, the warm-up's
#                   prompt widths and staged buckets, OFT's FP8 graphs and its layer stack ahead of time
#   sim_due  (900)  tools.bench.train_serve, PI0, closed-loop LIBERO actors, batch_due_ms 400 (a
#                   whole cycle: tools.bench.due_model), with the train_sims phase (the simulators alone)
#   sim_osmesa (900) sim_due with the simulators rendering on the CPU (env.gl=osmesa, one llvmpipe thread
#                   each; the kit built with --osmesa): what their EGL rendering on the learner's GPU cost
#   kernels  (480)  tools.bench.pi0_step_kernels --sweep at batch 1 and 8
#   tiles    (30)   the sweep's winners as TANDEM_PI0_STEP_TILES for the stages after it
#   levers   (660)  tools.bench.pi0_fast, PI0: default against the step layers, cuDNN prefix, fused SigLIP
#   one_gpu  (1500) tools.bench.one_gpu (the serving window, closed-loop actors served in step): batch-1 act, share of peak, training while serving (a
#                   robot's rate; closed-loop LIBERO actors), start-up cold / with artefacts / warm
#   pi0_serve (900) tools.bench.train_serve, PI0 alone: closed-loop LIBERO actors and a robot's rate,
#                   the window, the learner's default batching (one_gpu's control: batch_due_ms 0)
#   sim_threads (900) tools.bench.train_serve, both policies, closed-loop LIBERO actors in step, torch's
#                   default intra-op threads in the learner process (the A/B of the default, one thread on a GPU)
#   oft_fp8  (900)  tools.bench.oft_fast, the discrete OFT served in bf16 and with FP8 Llama linears:
#                   batch-1 act, share of peak by batch and at 8 actors, in one run
#   oft_fp8_serve (900) tools.bench.train_serve, that OFT's GRPO while serving 8 actors at a robot's
#                   rate and 8 closed-loop LIBERO actors (batch_due_ms 400) with FP8 serving and the window
#   aot_start (600) tools.bench.aot_start: start-up of a 32-layer stand-in compiled, from shipped
#                   artefacts, and as an ahead-of-time compiled function
#   oft_start (900) tools.bench.cold_start, the discrete OFT: cold, with shipped artefacts, and its layer
#                   stack ahead of time (compiled, then loaded on an empty cache)
#   pi0_start (900) tools.bench.cold_start, PI0: cold, with shipped artefacts, and its prefix stages
#                   ahead of time (compiled, then loaded on an empty cache)
#   pi05     (600)  tools.bench.pi0_fast, PI0.5: default against the step layers
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${TANDEM_PY:-python3}"
ALL_STAGES="tests gpu_new sim_due sim_osmesa kernels tiles levers one_gpu pi0_serve sim_threads oft_fp8 oft_fp8_serve aot_start oft_start pi0_start pi05"

limit_of() {
  case "$1" in
    tests) echo 720 ;; gpu_new) echo 600 ;; sim_due) echo 900 ;; sim_osmesa) echo 900 ;; kernels) echo 480 ;; tiles) echo 30 ;; levers) echo 660 ;;
    one_gpu) echo 1500 ;; pi0_serve) echo 900 ;; sim_threads) echo 900 ;; oft_fp8) echo 900 ;; oft_fp8_serve) echo 900 ;; aot_start) echo 600 ;; oft_start) echo 900 ;; pi0_start) echo 900 ;;
    pi05) echo 600 ;; *) return 1 ;;
  esac
}

command_of() {  # the stage's command line, one word per line
  local out="$1" stage="$2"
  case "$stage" in
    tests) printf '%s\n' "$PY" -m pytest -o addopts= -q -p no:cacheprovider \
      tests/test_pi0_step_layers.py tests/test_pi0_fused.py tests/test_pi0_fast.py tests/test_pi0_levers.py \
      tests/test_oft_fp8.py tests/test_oft_fast.py tests/test_oft_aot.py tests/test_pi0_aot.py tests/test_warmup.py ;;
    gpu_new) printf '%s\n' "$PY" -m pytest -o addopts= -q -p no:cacheprovider -k gpu \
      tests/test_pi0_aot.py tests/test_warmup.py tests/test_oft_fp8.py tests/test_oft_aot.py ;;
    sim_due) printf '%s\n' "$PY" -m tools.bench.train_serve --policies pi0 --actors 8 \
      --period sim --seconds 10 --repeats 1 --streams window --batch-due-ms 400 --env libero_spatial \
      --env-set gl=egl --env-set task_id=all --json "$out/sim_due.json" ;;
    sim_osmesa) printf '%s\n' env LP_NUM_THREADS=1 "$PY" -m tools.bench.train_serve --policies pi0 --actors 8 \
      --period sim --seconds 10 --repeats 1 --streams window --batch-due-ms 400 --env libero_spatial \
      --env-set gl=osmesa --env-set task_id=all --json "$out/sim_osmesa.json" ;;
    kernels) printf '%s\n' "$PY" -m tools.bench.pi0_step_kernels --batches 1,8 --sweep --json "$out/kernels.json" ;;
    tiles) printf '%s\n' "$PY" -m tools.bench.pi0_step_kernels --tiles-from "$out/kernels.json" ;;
    levers) printf '%s\n' "$PY" -m tools.bench.pi0_fast --variants pi0 --no-baseline --peak --profile \
      --levers default,default_step_layers,default_step_layers_b1,default_step_kv_cudnn_prefix,default_fuse_vision \
      --deadline-s 600 --json "$out/levers.json" ;;
    one_gpu) printf '%s\n' "$PY" -m tools.bench.one_gpu --repeats 1 --streams window --json "$out/one_gpu.json" ;;
    pi0_serve) printf '%s\n' "$PY" -m tools.bench.train_serve --policies pi0 --actors 8 --period sim,0.5 \
      --seconds 10 --repeats 1 --streams window --env libero_spatial --env-set gl=egl --env-set task_id=all \
      --json "$out/pi0_serve.json" ;;
    sim_threads) printf '%s\n' "$PY" -m tools.bench.train_serve --policies openvla_oft_discrete,pi0 --actors 8 \
      --period sim --seconds 10 --repeats 1 --streams window --batch-due-ms 400 --num-threads 0 --env libero_spatial \
      --env-set gl=egl --env-set task_id=all --json "$out/sim_threads.json" ;;
    oft_fp8) printf '%s\n' "$PY" -m tools.bench.oft_fast --heads discrete --levers default,fp8 --actors 8 \
      --json "$out/oft_fp8.json" ;;
    oft_fp8_serve) printf '%s\n' "$PY" -m tools.bench.train_serve --policies openvla_oft_discrete --actors 8 \
      --period 0.5,sim --seconds 10 --repeats 1 --streams window --batch-due-ms 400 --serving-set fast_llm_fp8=true \
      --env libero_spatial --env-set gl=egl --env-set task_id=all --json "$out/oft_fp8_serve.json" ;;
    aot_start) printf '%s\n' "$PY" -m tools.bench.aot_start --device cuda --repeats 1 --json "$out/aot_start.json" ;;
    oft_start) printf '%s\n' "$PY" -m tools.bench.cold_start --policy openvla_oft_discrete \
      --cases cold,artefacts,aot_cold,aot --json "$out/oft_start.json" ;;
    pi0_start) printf '%s\n' "$PY" -m tools.bench.cold_start --policy pi0 \
      --cases cold,artefacts,aot_cold,aot --json "$out/pi0_start.json" ;;
    pi05) printf '%s\n' "$PY" -m tools.bench.pi0_fast --variants pi05 --no-baseline \
      --levers default,default_step_layers --deadline-s 560 --json "$out/pi05.json" ;;
    *) echo "gpu_plan: unknown stage '$stage' (stages: $ALL_STAGES)" >&2; return 2 ;;
  esac
}

stages() { echo "${STAGES:-$ALL_STAGES}"; }

check_stages() {
  local s
  for s in $(stages); do
    limit_of "$s" >/dev/null || { echo "gpu_plan: unknown stage '$s' in STAGES (stages: $ALL_STAGES)" >&2; exit 2; }
  done
}

run_stage() {
  local out="$1" stage="$2" t0 rc
  if [ -f "$out/$stage.done" ]; then echo "$stage: done before, skipped" >> "$out/status"; return 0; fi
  local cmd=()
  mapfile -t cmd < <(command_of "$out" "$stage")
  if [ -f "$out/tiles.json" ] && [ -s "$out/tiles.json" ] && [ "$stage" != tiles ]; then
    export TANDEM_PI0_STEP_TILES="$(cat "$out/tiles.json")"
  fi
  echo "$stage: started $(date -u +%H:%M:%S) limit $(limit_of "$stage") s: ${cmd[*]}" >> "$out/status"
  t0=$(date +%s)
  if [ "$stage" = tiles ]; then
    timeout --signal=INT --kill-after=20 "$(limit_of "$stage")" "${cmd[@]}" > "$out/tiles.json" 2> "$out/tiles.log"
  else
    timeout --signal=INT --kill-after=20 "$(limit_of "$stage")" "${cmd[@]}" > "$out/$stage.log" 2>&1
  fi
  rc=$?
  if [ "$rc" = 0 ]; then
    touch "$out/$stage.done"
    echo "$stage: ok in $(( $(date +%s) - t0 )) s" >> "$out/status"
  else
    echo "$stage: failed rc $rc after $(( $(date +%s) - t0 )) s (log: $stage.log)" >> "$out/status"
  fi
  return 0
}

run_all() {
  local out="$1" s
  mkdir -p "$out"
  echo "plan: started $(date -u +%Y-%m-%dT%H:%M:%SZ) stages: $(stages)" >> "$out/status"
  for s in $(stages); do run_stage "$out" "$s"; done
  echo "plan: finished $(date -u +%H:%M:%S)" >> "$out/status"
  touch "$out/finished"
}

status() {
  local out="$1" s
  for s in $(stages); do
    if [ -f "$out/$s.done" ]; then echo "$s: ok"
    elif grep -q "^$s: failed" "$out/status" 2>/dev/null; then grep "^$s: failed" "$out/status" | tail -n 1
    elif grep -q "^$s: started" "$out/status" 2>/dev/null; then echo "$s: running (or cut short)"
    else echo "$s: to do"; fi
  done
}

main() {
  local verb="${1:-}" out="${2:-runs/gpu_plan}"
  case "$verb" in
    list)
      check_stages
      for s in $(stages); do echo "$s ($(limit_of "$s") s): $(command_of "\$OUT" "$s" | tr '\n' ' ')"; done ;;
    run)
      check_stages
      if [ -x launch/gpu_box.sh ] && [ -z "${TANDEM_PLAN_NO_KIT:-}" ]; then eval "$(launch/gpu_box.sh env)"; fi
      run_all "$out" ;;
    start)
      check_stages
      mkdir -p "$out"
      rm -f "$out/finished"
      setsid "$0" run "$out" > "$out/plan.log" 2>&1 < /dev/null &
      echo "gpu_plan: started (pid $!), status in $out/status" ;;
    status) check_stages; status "$out" ;;
    collect)
      local dest="${3:?collect needs OUT and DEST}"
      mkdir -p "$dest"
      (cd "$out" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.log' -o -name '*.done' -o -name status \
        -o -name finished \) -print0 | tar --null -czf "$dest/gpu_plan.tgz" -T -)
      status "$out" ;;
    *) echo "usage: tools/bench/gpu_plan.sh start|run|status|collect|list [OUT] [DEST]" >&2; exit 2 ;;
  esac
}

main "$@"
