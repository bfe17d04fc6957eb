#!/usr/bin/env python
"""VLA serving benchmark: PI0 and OpenVLA-OFT behind Tandem's learner socket.

Self-contained: it builds the full-size models with random weights (bf16 on a GPU) from
configs, plus small local tokenizers; nothing is downloaded. Per policy, in one run:

- ``bare_forward_ms``: the model call alone on prepared tensors (PI0: lerobot's
  ``PI0Pytorch.sample_actions``, 10 flow steps; OFT: the VLA + action head), batch 1;
- ``act_ms``: ``policy.act(obs)`` for one observation (observation mapping included), and
  ``overhead_ratio = act_p50 / bare_p50`` (target: act <= 1.1 x bare + 0.5 ms);
- ``socket_ms``: one actor's act round trip through a real ``LearnerService`` +
  ``InferenceServer`` (loopback), from the actor's ``LearnerClient``;
- ``actors``: actions/s (chunks/s x chunk size) with 1, 4, 8, 16 concurrent actors, each a
  separate process running the real ``actor.client.LearnerClient`` in a closed loop, with the
  mean served batch size (target: 8 actors >= 4 x the actions/s of 1);
- ``train_step_ms``: one LoRA training step (bc_loss, backward, AdamW) at ``--train-batch``;
- ``peak_gpu_gb``: ``torch.cuda.max_memory_allocated`` while serving, training and running
  the baseline (``build_peak_gpu_gb``: while building);
- ``snapshot_mb`` vs ``model_mb``: the trainable (LoRA + heads) weight snapshot vs the model,
  and ``load_weights_ms``: loading a snapshot into the serving copy (adapters re-folded);
- PI0 only, ``lerobot_select_action_ms``: lerobot's own ``PI0Policy.select_action`` (queue
  reset every call, so each call computes a chunk) on the same inputs, built without LoRA.

    python -m tools.bench_policy                    # GPU, full size, human-readable
    python -m tools.bench_policy --json out.json    # also write every figure as JSON
    python -m tools.bench_policy --tiny --device cpu --actors 1,2 --seconds 2   # CPU smoke

Imports only torch, transformers, safetensors, tokenizers, timm, peft, lerobot (PI0 modules
alone when lerobot's data stack is absent), pyzmq, msgpack, gymnasium.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TASK = "pick up the black bowl between the plate and the ramekin and place it on the plate"
HASH = "bench"


def make_obs(state_dim: int, cams: dict, n: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    obs = {"observation.state": rng.uniform(-1, 1, (n, state_dim)).astype(np.float32)}
    for c, (h, w, _) in cams.items():
        obs[f"observation.images.{c}"] = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    return obs


# -- actor process (light: numpy, zmq, the actor client) -----------------------------------------
def client_main(a) -> None:
    import zmq

    from actor.client import LearnerClient
    from actor.spool import Spool

    cams = json.loads(a.cams)
    obs = make_obs(a.state_dim, cams, seed=a.seed)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        cl = LearnerClient(ctx=ctx, host="127.0.0.1", port=a.port, actor_id=a.actor_id, config_hash=HASH,
                           spool=Spool(Path(tmp) / "spool", fsync=False), timeout_s=120.0, heartbeat_s=60.0)
        cl.connect(give_up_after_s=60)
        actions, _ = cl.act(obs, [TASK])  # warm-up, also registers this actor as active
        print("ready", flush=True)
        sys.stdin.readline()  # all actors start together
        lat, versions, t_end = [], set(), time.perf_counter() + a.seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            actions, v = cl.act(obs, [TASK])
            lat.append((time.perf_counter() - t0) * 1000.0)
            versions.add(int(v))
        print(json.dumps({"n": len(lat), "lat_ms": lat, "shape": list(actions.shape), "versions": sorted(versions)}))
        cl.close()
    ctx.destroy(0)


def run_actors(n: int, port: int, seconds: float, state_dim: int, cams: dict, counters=None) -> dict:
    """``n`` actor processes in a closed act loop for ``seconds``, started together once all
    have connected and been served one warm-up request. ``counters()`` -> (forwards, requests)
    of the inference server gives the mean batch size over the timed window."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tools.bench_policy", "--client", "--port", str(port), "--actor-id", f"bench{i}",
         "--seconds", str(seconds), "--state-dim", str(state_dim), "--cams", json.dumps(cams), "--seed", str(i)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            p.wait(60)
            raise RuntimeError(f"actor process failed to connect (rc {p.returncode})")
    c0 = counters() if counters else (0, 0)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 240)
        if p.returncode != 0:
            raise RuntimeError(f"actor process failed (rc {p.returncode}): {out[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    c1 = counters() if counters else (1, 1)
    lat = np.concatenate([o["lat_ms"] for o in outs])
    chunks = sum(o["n"] for o in outs)
    return {"actors": n, "chunks": chunks, "chunks_per_s": chunks / seconds, "lat_p50_ms": float(np.percentile(lat, 50)),
            "lat_p99_ms": float(np.percentile(lat, 99)), "reply_shape": outs[0]["shape"],
            "mean_batch": (c1[1] - c0[1]) / max(1, c1[0] - c0[0])}


# -- learner side ------------------------------------------------------------------------------------
def timed(fn, iters: int, warmup: int, sync) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def pct(xs: list[float]) -> dict:
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99)), "n": len(xs)}


def build(name: str, tiny: bool, device: str, tmp: Path, spec):
    """(policy, config) for ``name`` at full size (random weights) or tiny (test checkpoint)."""
    from agents.policies.openvla_oft import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    from agents.policies.pi0 import Pi0Policy, Pi0PolicyConfig
    from tools.make_tiny_checkpoints import build_tokenizer, make_openvla_oft, make_pi0

    if name == "pi0":
        if tiny:
            cfg = Pi0PolicyConfig(checkpoint=str(make_pi0(tmp / "pi0", spec)), chunk_size=8, device=device, lora_rank=4)
        else:
            cfg = Pi0PolicyConfig(tokenizer=str(build_tokenizer(tmp / "pi0_tok", kind="gemma")), device=device)
        return Pi0Policy(cfg, spec), cfg
    if tiny:
        cfg = OpenVLAOFTPolicyConfig(checkpoint=str(make_openvla_oft(tmp / "oft", spec)), device=device, lora_rank=4)
    else:
        cfg = OpenVLAOFTPolicyConfig(tokenizer=str(build_tokenizer(tmp / "oft_tok", kind="llama", vocab_size=2000)),
                                     device=device)
    return OpenVLAOFTPolicy(cfg, spec), cfg


def bench_policy(name: str, args, spec, tmp: Path) -> dict:
    import torch
    import zmq

    from agents.policies import vla_common as vc
    from data.replay import ReplayBuffer
    from learner.inference import InferenceServer
    from learner.ingest import Ingest
    from learner.service import LearnerService
    from learner.weights import WeightPublisher

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    policy, cfg = build(name, args.tiny, args.device, tmp, spec)
    policy.eval()
    res: dict = {"build_s": time.perf_counter() - t0, "chunk": policy.chunk_size}
    if cuda:
        res["build_peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    snap = policy.trainable_state_dict()
    res["params_m"] = vc.n_params(policy) / 1e6
    res["model_mb"] = sum(p.numel() * p.element_size() for p in policy.parameters()) / 1e6
    res["snapshot_mb"] = vc.state_nbytes(snap) / 1e6
    res["snapshot_tensors"] = len(snap)
    obs_np = make_obs(spec.state_dim, spec.cameras)
    obs = {k: torch.from_numpy(v) for k, v in obs_np.items()}
    obs["task"] = [TASK]
    it, wu = args.iters, args.warmup
    with torch.inference_mode():
        inputs = policy.model_inputs(obs)
        res["bare_forward_ms"] = pct(timed(lambda: policy.forward_model(inputs), it, wu, sync))
        res["act_ms"] = pct(timed(lambda: policy.act(obs), it, wu, sync))
    with torch.no_grad():  # a new weights version on the serving copy: unfold, load, fold
        res["load_weights_ms"] = pct(timed(lambda: policy.load_trainable_state_dict(snap), 3, 1, sync))
    res["overhead_ratio"] = res["act_ms"]["p50"] / res["bare_forward_ms"]["p50"]
    res["act_target_ms"] = 1.1 * res["bare_forward_ms"]["p50"] + 0.5
    res["act_within_target"] = res["act_ms"]["p50"] <= res["act_target_ms"]

    # through the real learner socket
    ctx = zmq.Context()
    svc = LearnerService(ctx=ctx, spec=spec, config_hash=HASH, ingest=Ingest(ReplayBuffer(8, spec)),
                         submit_act=lambda r: inf.submit(r), get_version=lambda: pub.version,
                         get_weights=lambda: pub.latest(), port=0, pub_port=0, peer_timeout_s=600.0)
    inf = InferenceServer(policy, reply=svc.reply, active_actors=svc.active_actors, device=dev,
                          max_batch=64, batch_window_ms=args.batch_window_ms)
    pub = WeightPublisher(inf.set_weights, svc.publish)
    pub.publish(snap, version=1)
    svc.start()
    inf.start()
    try:
        cams = {c: list(s) for c, s in spec.cameras.items()}
        counters = lambda: (inf.batches, inf.served)  # noqa: E731
        one = run_actors(1, svc.port, args.seconds, spec.state_dim, cams, counters)
        res["socket_ms"] = {"p50": one["lat_p50_ms"], "p99": one["lat_p99_ms"]}
        res["actors"] = []
        for n in args.actors:
            r = one if n == 1 else run_actors(n, svc.port, args.seconds, spec.state_dim, cams, counters)
            r["actions_per_s"] = r["chunks_per_s"] * policy.chunk_size
            res["actors"].append(r)
    finally:
        inf.stop()
        svc.stop()
        inf.join(5)
        svc.join(5)
        ctx.destroy(0)
    by_n = {r["actors"]: r["actions_per_s"] for r in res["actors"]}
    if 1 in by_n and 8 in by_n:
        res["scaling_8_vs_1"] = by_n[8] / by_n[1]

    # one LoRA training step
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    bt = args.train_batch
    tb = {k: torch.from_numpy(np.repeat(v, bt, axis=0)) for k, v in obs_np.items()}
    tb["task"] = [TASK] * bt
    tb["action"] = torch.rand(bt, policy.chunk_size, spec.action_dim) * 2 - 1

    def step():
        opt.zero_grad(set_to_none=True)
        policy.bc_loss(tb).backward()
        opt.step()
    res["train_step_ms"] = pct(timed(step, max(2, it // 5), 1, sync))
    res["train_batch"] = bt
    del opt
    policy.eval()

    if name == "pi0" and not args.no_baseline:
        res["lerobot_select_action_ms"] = lerobot_baseline(policy, obs, args, sync)
    if cuda:
        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del policy
    return res


def lerobot_baseline(policy, obs, args, sync) -> dict:
    """lerobot's own PI0Policy.select_action (a copy without LoRA, same weights) on the same batch."""
    import torch

    from agents.policies.pi0 import build_lerobot_pi

    plain = build_lerobot_pi("pi0", policy.lr_cfg, policy.arch, seed=policy.cfg.seed)
    base = {k: v for k, v in policy.inner.state_dict().items() if ".lora_" not in k}
    plain.load_state_dict({k.replace(".base_layer", ""): v for k, v in base.items()}, strict=True)
    plain.eval()
    with torch.inference_mode():
        lb = policy.lerobot_batch(obs)

        def call():
            plain.reset()
            plain.select_action(lb)
        out = pct(timed(call, args.iters, args.warmup, sync))
    del plain
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="pi0,openvla_oft")
    ap.add_argument("--tiny", action="store_true", help="tiny test-size models (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--actors", default="1,4,8,16")
    ap.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--batch-window-ms", type=float, default=2.0)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout only JSON)")
    # actor process mode
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--actor-id", help=argparse.SUPPRESS)
    ap.add_argument("--state-dim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cams", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        client_main(args)
        return {}

    import torch

    from data.core.spec import EnvSpec

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny models: threads only fight the actor processes for cores
    args.actors = [int(x) for x in args.actors.split(",")]
    s = args.image_size
    spec = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (s, s, 3), "wrist_image": (s, s, 3)}, has_task=True)
    out = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "tiny": args.tiny, "image_size": s, "policies": {}}
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.policies.split(","):
            say(f"== {name} ({'tiny' if args.tiny else 'full size'}, {out['device']})", flush=True)
            r = bench_policy(name, args, spec, Path(tmp))
            out["policies"][name] = r
            say(report(name, r), flush=True)
    if args.json == "-":
        print(json.dumps(out))
    elif args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def report(name: str, r: dict) -> str:
    lines = [f"  params {r['params_m']:.1f} M, model {r['model_mb']:.1f} MB, trainable snapshot "
             f"{r['snapshot_mb']:.2f} MB ({r['snapshot_tensors']} tensors, {r['snapshot_mb'] / r['model_mb']:.2%}), "
             f"build {r['build_s']:.1f} s",
             f"  bare forward p50 {r['bare_forward_ms']['p50']:.2f} ms p99 {r['bare_forward_ms']['p99']:.2f} ms",
             f"  act          p50 {r['act_ms']['p50']:.2f} ms p99 {r['act_ms']['p99']:.2f} ms  overhead x"
             f"{r['overhead_ratio']:.3f} (target <= {r['act_target_ms']:.2f} ms: "
             f"{'ok' if r['act_within_target'] else 'MISSED'})",
             f"  socket, 1 actor p50 {r['socket_ms']['p50']:.2f} ms p99 {r['socket_ms']['p99']:.2f} ms",
             f"  new weights version on the serving copy p50 {r['load_weights_ms']['p50']:.1f} ms"]
    for a in r["actors"]:
        lines.append(f"  {a['actors']:>2} actors: {a['actions_per_s']:9.1f} actions/s ({a['chunks_per_s']:.1f} chunks/s, "
                     f"mean batch {a['mean_batch']:.1f}, p50 {a['lat_p50_ms']:.1f} ms)")
    if "scaling_8_vs_1" in r:
        lines.append(f"  8 vs 1 actors: x{r['scaling_8_vs_1']:.2f} (target >= 4: "
                     f"{'ok' if r['scaling_8_vs_1'] >= 4 else 'MISSED'})")
    lines.append(f"  LoRA train step (batch {r['train_batch']}) p50 {r['train_step_ms']['p50']:.1f} ms")
    if "lerobot_select_action_ms" in r:
        b = r["lerobot_select_action_ms"]
        lines.append(f"  lerobot PI0 select_action p50 {b['p50']:.2f} ms p99 {b['p99']:.2f} ms (no LoRA)")
    if "peak_gpu_gb" in r:
        lines.append(f"  peak GPU memory {r['peak_gpu_gb']:.1f} GB serving + training (building: "
                     f"{r['build_peak_gpu_gb']:.1f} GB)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
