"""Where PI0's fast serving time goes on a GPU: a kernel profile of one batch-1 call (2 cameras
at 224, 10 flow steps, full size, random bf16 weights, LoRA 16 folded), grouped by kind, and
the forward p50 of variants measured in the same run:

- ``graphs``: the fast path as served (``policy.fast_serving=auto``);
- ``compile``: plus ``policy.fast_compile=true``;
- ``compile_vision_bf16``: plus SigLIP and the projector cast to bf16 (lerobot keeps them in
  float32); the max abs difference of its actions from the float32-vision ones is recorded.

The profile runs the compiled path without CUDA graphs (same kernels, visible one by one).

    python -m tools.bench.pi0_profile --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

KINDS = [("attention", r"fmha|flash|attention|attn"), ("gemm_fp32", r"sgemm|tf32|f32f32|s1688|s16816gemm.*f32"),
         ("gemm", r"gemm|cutlass|xmma|nvjet|matmul|cublas"), ("triton", r"^triton_"),
         ("elementwise", r"elementwise|vectorized|reduce|unrolled|cat|copy|index|softmax|norm")]


def kind(name: str) -> str:
    low = name.lower()
    for k, pat in KINDS:
        if re.search(pat, low):
            return k
    return "other"


def profile(fn, sync, calls: int = 3) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as tprof

    fn()
    sync()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        by_kind[kind(ev.name)] += us / calls
        by_name[ev.name][0] += us / calls
        by_name[ev.name][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"gpu_ms_per_call": sum(by_kind.values()) / 1000,
            "by_kind_ms": {k: round(v / 1000, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernels_per_call": sum(c for _, c in by_name.values()) / calls,
            "top": [{"name": n[:140], "ms": round(t / 1000, 3), "count": c // calls} for n, (t, c) in top]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from agents.policies.pi0.fast import FastPiSampler
    from tools.bench.common import bench_spec, gpu_state, p50_p99, random_obs, timed_ms
    from tools.make_tiny_checkpoints import build_tokenizer

    sync = torch.cuda.synchronize
    res: dict = {"device_name": torch.cuda.get_device_name(), "gpu_before": gpu_state()}
    with tempfile.TemporaryDirectory() as tmp:
        spec = bench_spec(8, 7, ["image", "wrist_image"], 224, has_task=True)
        policy = Pi0Policy(Pi0PolicyConfig(tokenizer=str(build_tokenizer(Path(tmp) / "tok", kind="gemma")),
                                           device="cuda"), spec).eval()
    obs = {k: torch.from_numpy(v) for k, v in random_obs(spec.state_dim, spec.cameras).items()}
    obs["task"] = ["pick up the black bowl between the plate and the ramekin and place it on the plate"]
    d = int(policy.lr_cfg.max_action_dim)

    def timed(fn):
        return p50_p99(timed_ms(fn, a.iters, 5, sync, max_iters=4 * a.iters))

    with torch.inference_mode():
        inputs = policy.model_inputs(obs)
        noise = torch.randn(1, policy.chunk_size, d, device=policy.device)
        fwd = lambda: policy.forward_model(inputs, noise)  # noqa: E731
        ref = fwd()
        res["graphs_forward_ms"] = timed(fwd)
        policy._fast, policy.cfg.fast_compile = None, True
        comp = fwd()
        res["compile_forward_ms"] = timed(fwd)
        res["compile_max_abs_diff"] = float((comp - ref).abs().max())
        sampler = policy._fast
        # the profile: the same compiled computation without graphs
        ungraphed = FastPiSampler(policy.inner.model, policy.variant, graphs=False, compile=False)
        ungraphed._velocity, ungraphed._embed_image, ungraphed._prefix_kv = (
            sampler._velocity, sampler._embed_image, sampler._prefix_kv)
        steps = int(policy.lr_cfg.num_inference_steps)
        images, img_masks, toks, masks = inputs[:4]
        state = inputs[4] if len(inputs) > 4 else None
        args = (images, img_masks, toks, masks, state, noise.to(torch.float32), steps)
        try:
            res["profile_compiled_ungraphed"] = profile(lambda: ungraphed._sample(*args), sync)
        except Exception as exc:  # noqa: BLE001 - recorded; the timings below still run
            res["profile_error"] = f"{type(exc).__name__}: {exc}"[:800]
        try:
            # SigLIP + projector in bf16
            pm = policy.inner.model.paligemma_with_expert.paligemma.model
            pm.vision_tower.to(torch.bfloat16)
            pm.multi_modal_projector.to(torch.bfloat16)

            def embed_bf16(image):
                return pm.get_image_features(image.to(torch.bfloat16)).pooler_output

            policy._fast = FastPiSampler(policy.inner.model, policy.variant, graphs=True, compile=True)
            policy._fast._embed_image = torch.compile(embed_bf16, dynamic=False)
            vb = fwd()
            res["compile_vision_bf16_forward_ms"] = timed(fwd)
            res["vision_bf16_max_abs_diff_vs_fp32"] = float((vb - comp).abs().max())
            res["actions_abs_max"] = float(comp.abs().max())
        except Exception as exc:  # noqa: BLE001
            res["vision_bf16_error"] = f"{type(exc).__name__}: {exc}"[:800]
    res["gpu_after"] = gpu_state()
    res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return res


if __name__ == "__main__":
    main()
