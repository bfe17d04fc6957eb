#!/usr/bin/env bash
# A GPU box without internet: install the kit that tools/gpu_kit.py built, then run a learner
# and N LIBERO actors on it (the box's own python3, which holds torch).
#
#   launch/gpu_box.sh install                 # every .kit/partK present (run once per part carried)
#   launch/gpu_box.sh check                   # the learner's and a LIBERO actor's imports, EGL
#   launch/gpu_box.sh start --actors 14 --run-dir runs/x [learner overrides] -- [actor overrides]
#   launch/gpu_box.sh wait --run-dir runs/x [--timeout S]    # until the learner exits
#   launch/gpu_box.sh stop --run-dir runs/x   # SIGTERM (checkpoint, spools kept), then SIGKILL
#                                             # after TANDEM_STOP_WAIT_S (120) s, naming who was left
#   eval "$(launch/gpu_box.sh env)"           # the variables start sets, for your own commands
#   launch/gpu_box.sh collect --to DIR [--need PATH]... [--until FILE]... [--timeout S] PATH...
#                                             # wait for FILEs to be non-empty (at most S s), then pack PATHs into
#                                             # DIR/collect.tgz whether or not they all came; a
#                                             # --need PATH that is absent stops it at once (exit 4)
#
# TANDEM_KIT (default .kit) is where the parts are, TANDEM_SITE (default /tmp/tandem-site) where
# they install. Learner overrides go to launch/run_learner.sh; those after -- to every
# launch/run_actor.sh (plus actor_id=actor-<i>, env.gl=egl). Overrides both need (env=...,
# policy=...) go in both lists. Logs: <run-dir>/learner.log, <run-dir>/actor-<i>.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${TANDEM_KIT:-$ROOT/.kit}"
SITE="${TANDEM_SITE:-/tmp/tandem-site}"
PY="${TANDEM_PYTHON:-python3}"

env_lines() {
  local assets
  assets="$(ls "$SITE"/assets/*.tar.* 2>/dev/null | head -n 1 || true)"
  echo "export PYTHONPATH=$SITE:$ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export TANDEM_PYTHON=$PY MUJOCO_GL=egl PYOPENGL_PLATFORM=egl PYTHONUNBUFFERED=1"
  [ -n "$assets" ] && echo "export TANDEM_LIBERO_ASSETS_TARBALL=$assets"
  # NVIDIA's EGL vendor file, where the driver mount has one
  local vendor=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  [ -f "$vendor" ] && echo "export __EGL_VENDOR_LIBRARY_FILENAMES=$vendor"
  # the kit's OSMesa (--osmesa), after the box's own libraries: env.gl=osmesa renders on the CPU
  local osmesa="$SITE/osmesa/usr/lib/x86_64-linux-gnu"
  [ -d "$osmesa" ] && echo "export LD_LIBRARY_PATH=\${LD_LIBRARY_PATH:+\$LD_LIBRARY_PATH:}$osmesa"
  return 0
}

install_parts() {
  mkdir -p "$SITE/assets"
  local found=0
  for part in "$KIT"/part*/; do
    [ -d "$part" ] || continue
    found=1
    local name; name="$(basename "$part")"
    if [ -f "$SITE/.installed-$name" ]; then echo "$name: already installed"; continue; fi
    if compgen -G "$part/wheels/*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$part"/wheels/*.whl
    fi
    for t in "$part"/site/*.tar.*; do [ -f "$t" ] && tar -xf "$t" -C "$SITE"; done
    for a in "$part"/assets/*; do [ -f "$a" ] && cp "$a" "$SITE/assets/"; done
    if compgen -G "$part/gl/*.deb" >/dev/null && ! ldconfig -p | grep -q 'libEGL.so.1'; then
      for d in "$part"/gl/*.deb; do dpkg -x "$d" /; done
      ldconfig
    fi
    if compgen -G "$part/osmesa/*.deb" >/dev/null; then  # under the site folder: no box library replaced
      mkdir -p "$SITE/osmesa"
      for d in "$part"/osmesa/*.deb; do dpkg -x "$d" "$SITE/osmesa"; done
    fi
    touch "$SITE/.installed-$name"
    echo "$name: installed into $SITE"
  done
  [ "$found" = 1 ] || { echo "no kit parts under $KIT (build them with: python -m tools.gpu_kit --out .kit)" >&2; exit 2; }
}

check() {
  eval "$(env_lines)"
  "$PY" - <<'PY'
import importlib, sys
missing = []
for m in ("learner.app", "actor.app", "agents.policies.pi0.policy", "data.store", "data.demos", "envs.libero.env",
          "robosuite", "libero.libero.envs", "mujoco"):
    try:
        importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001 - report every failure
        missing.append(f"{m}: {type(exc).__name__}: {exc}")
if missing:
    print("kit check failed:\n  " + "\n  ".join(missing)); sys.exit(1)
import numpy as np
from envs.libero.env import LiberoEnv
env = LiberoEnv("libero_spatial", 0, init_state_id=0, image_size=64)
obs, _ = env.reset(seed=0)
env.step(np.zeros(7))
print("kit check ok: imports, LIBERO reset and EGL render", obs["observation.images.image"].shape)
env.close()
PY
}

start() {
  local actors=12 run_dir="" learner=() actor=() side=learner
  while [ $# -gt 0 ]; do
    case "$1" in
      --actors) actors="$2"; shift 2 ;;
      --run-dir) run_dir="$2"; shift 2 ;;
      --) side=actor; shift ;;
      *) if [ "$side" = learner ]; then learner+=("$1"); else actor+=("$1"); fi; shift ;;
    esac
  done
  [ -n "$run_dir" ] || { echo "start needs --run-dir" >&2; exit 2; }
  mkdir -p "$run_dir"
  eval "$(env_lines)"
  : > "$run_dir/pids"
  # TANDEM_LEARNER_GPU: the one GPU the learner sees (CUDA_VISIBLE_DEVICES for the learner alone:
  # robosuite's EGL renderer in the actors takes its device from CUDA_VISIBLE_DEVICES);
  # TANDEM_RENDER_GPU: the EGL device the actors render on (MUJOCO_EGL_DEVICE_ID; default the first)
  env ${TANDEM_LEARNER_GPU:+CUDA_VISIBLE_DEVICES=$TANDEM_LEARNER_GPU} \
    setsid "$ROOT/launch/run_learner.sh" run_dir="$run_dir" "${learner[@]}" >"$run_dir/learner.log" 2>&1 &
  echo "learner $!" >> "$run_dir/pids"
  for _ in $(seq 1 600); do   # until the learner serves (its start-up line)
    grep -q "serving on" "$run_dir/learner.log" 2>/dev/null && break
    kill -0 "$(awk '/^learner/{print $2}' "$run_dir/pids")" 2>/dev/null || { tail -n 30 "$run_dir/learner.log"; exit 1; }
    sleep 1
  done
  for i in $(seq 0 $((actors - 1))); do
    # one thread of BLAS / OpenMP each: N simulator processes share the box's cores with the learner
    # TANDEM_ACTOR_PREFIX (default actor): actor ids <prefix>-<i>; each id has its own reset seeds
    # (actor.seed: null), so a new prefix gives new start states
    # TANDEM_ACTOR_NICE (default 0): the actors' niceness, so that the learner's threads (update,
    # serving, ingest) get the cores first when the simulators fill the box
    env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ${TANDEM_RENDER_GPU:+MUJOCO_EGL_DEVICE_ID=$TANDEM_RENDER_GPU} \
    setsid nice -n "${TANDEM_ACTOR_NICE:-0}" "$ROOT/launch/run_actor.sh" actor_id="${TANDEM_ACTOR_PREFIX:-actor}-$i" run_dir="$run_dir" env.gl=egl "${actor[@]}" \
      >"$run_dir/actor-$i.log" 2>&1 &
    echo "actor-$i $!" >> "$run_dir/pids"
  done
  echo "started a learner and $actors actors; logs in $run_dir"
}

wait_learner() {
  local run_dir="" timeout=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --run-dir) run_dir="$2"; shift 2 ;;
      --timeout) timeout="$2"; shift 2 ;;
      *) echo "wait: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  local pid; pid="$(awk '/^learner/{print $2}' "$run_dir/pids")"
  local t=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2; t=$((t + 2))
    if [ "$timeout" != 0 ] && [ "$t" -ge "$timeout" ]; then echo "learner still running after ${timeout}s"; return 1; fi
  done
}

stop() {
  local run_dir=""
  while [ $# -gt 0 ]; do case "$1" in --run-dir) run_dir="$2"; shift 2 ;; *) shift ;; esac; done
  [ -f "$run_dir/pids" ] || return 0
  # SIGTERM: a process started in the background by a script ignores SIGINT
  while read -r _ pid; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done < "$run_dir/pids"
  local wait_s="${TANDEM_STOP_WAIT_S:-120}"
  for _ in $(seq 1 "$wait_s"); do
    alive=0
    while read -r _ pid; do kill -0 "$pid" 2>/dev/null && alive=1; done < "$run_dir/pids"
    [ "$alive" = 0 ] && return 0
    sleep 1
  done
  # still alive after TANDEM_STOP_WAIT_S (120) s: say which (the run's logs tell why), then kill them
  while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then echo "stop: $name (pid $pid) still running ${wait_s} s after SIGTERM; SIGKILL" >&2; fi
  done < "$run_dir/pids"
  while read -r _ pid; do kill -KILL -- "-$pid" 2>/dev/null || true; done < "$run_dir/pids"
}

collect() {
  # A lent box can go away between two calls (an idle limit, a lease that ends): every poll
  # should bring back what the run has written so far, not only the final results.
  local to="" timeout=0 until=() paths=() need=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --to) to="$2"; shift 2 ;;
      --need) need+=("$2"); shift 2 ;;
      --until) until+=("$2"); shift 2 ;;
      --timeout) timeout="$2"; shift 2 ;;
      -*) echo "collect: unknown option $1" >&2; exit 2 ;;
      *) paths+=("$1"); shift ;;
    esac
  done
  [ -n "$to" ] && [ ${#paths[@]} -gt 0 ] || { echo "collect needs --to DIR and at least one PATH" >&2; exit 2; }
  for n in "${need[@]}"; do
    # a fresh box (the last one went back while idle) has none of the run: say so at once
    # rather than wait out the timeout on device time
    [ -e "$n" ] || { echo "collect: $n is not on this box: the run is gone (a fresh box?)"; return 4; }
  done
  local t=0 missing=()
  while :; do
    missing=()
    for f in "${until[@]}"; do [ -s "$f" ] || missing+=("$f"); done  # empty: still being written
    [ ${#missing[@]} = 0 ] && break
    [ "$t" -ge "$timeout" ] && break
    sleep 2; t=$((t + 2))
  done
  local present=()
  for p in "${paths[@]}"; do
    if [ -e "$p" ]; then present+=("$p"); else echo "collect: $p does not exist (skipped)" >&2; fi
  done
  mkdir -p "$to"
  if [ ${#present[@]} -gt 0 ]; then
    # exit 1: a file changed while it was read (a live run writes on); the archive is still whole
    tar -czf "$to/collect.tgz" --ignore-failed-read "${present[@]}" || [ $? = 1 ]
    echo "collect: $(du -k "$to/collect.tgz" | cut -f1) KiB of ${#present[@]} path(s) in $to/collect.tgz after ${t}s"
  fi
  if [ ${#missing[@]} -gt 0 ]; then echo "collect: still missing after ${t}s: ${missing[*]}"; return 3; fi
}

cmd="${1:-}"; shift || true
case "$cmd" in
  install) install_parts ;;
  check) check ;;
  env) env_lines ;;
  start) start "$@" ;;
  wait) wait_learner "$@" ;;
  stop) stop "$@" ;;
  collect) collect "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
