"""One run of the scaling benchmark (:mod:`tools.bench.scaling_cli`), on every rank of a launch.

Each rank builds the whole policy (random bf16 weights at full size, as
:mod:`tools.bench.policy` does; the tiny test checkpoints with ``--tiny``), puts its BC loss
behind one ``accelerator.prepare``-d module with an AdamW optimizer (the rejection-sampling
learner's :class:`agents.rs.agent.BCLoss`; DDP or a DeepSpeed engine), and runs
optimizer steps of a fixed *global* batch: rank r takes ``global_batch / N`` samples per
step, ``micro_batch`` at a time with gradient accumulation (``accelerator.accumulate``; under
DeepSpeed the engine's ``gradient_accumulation_steps`` is set to the same count). Timed
after the warm-up steps, with a device synchronisation and a barrier around each step.

Errors (out of memory included) are caught per phase (build, prepare, step); the ranks
agree on them through one gather, rank 0 writes them into the JSON, and every rank returns
normally. A rank stuck in a collective its peer never reaches ends with the collective
timeout (``--timeout-s``); rank 0 writes the JSON as soon as it sees its own error.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CASES = ("oft_lora", "pi0_lora", "pi0_full")
TASK = "pick up the black bowl and place it on the plate"


def patch_deepspeed_config(accum: int, micro: int, tmp: Path) -> dict | None:
    """Under ``accelerate launch --use_deepspeed --deepspeed_config_file F``: point accelerate at
    a copy of F whose ``gradient_accumulation_steps`` is ``accum`` (the engine scales the loss
    by it and steps at its boundaries) and ``train_micro_batch_size_per_gpu`` is ``micro``.
    Returns the copy's content, or None when DeepSpeed is off."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    src = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if src == "none":
        raise ValueError("DeepSpeed without --deepspeed_config_file: pass config/deepspeed/zero{2,3}.json")
    cfg = json.loads(Path(src).read_text())
    cfg["gradient_accumulation_steps"] = int(accum)
    cfg["train_micro_batch_size_per_gpu"] = int(micro)
    cfg.pop("train_batch_size", None)  # DeepSpeed computes it: micro x accum x world
    dst = tmp / f"ds_{os.environ.get('RANK', '0')}.json"
    dst.write_text(json.dumps(cfg))
    os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(dst)
    return cfg


def tiny_checkpoint(case: str, spec, root: Path) -> Path:
    """The tiny test checkpoint of ``case`` under ``root``, made there once (tools/make_tiny_checkpoints)
    and reused: the matrix makes it before its launches, so that the ranks only load it."""
    from tools.make_tiny_checkpoints import make_openvla_oft, make_pi0

    name = "oft" if case.startswith("oft") else "pi0"
    done = root / f"{name}.done"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        path = (make_openvla_oft if name == "oft" else make_pi0)(root / name, spec)
        done.write_text(str(path))
    return Path(done.read_text())


def build_policy(case: str, tiny: bool, device: str, tmp: Path, spec, tiny_dir: Path | None = None):
    """The policy of ``case``: OpenVLA-OFT (L1 head) with LoRA, PI0 with LoRA, or PI0 with every
    parameter trainable and no LoRA (``pi0_full``); built as tools/bench/policy.build does."""
    from agents.parallel import whole_weights

    with whole_weights():  # ZeRO-3: built whole on each rank, partitioned by prepare (as the learner)
        return _build_policy(case, tiny, device, tmp, spec, tiny_dir)


def _build_policy(case: str, tiny: bool, device: str, tmp: Path, spec, tiny_dir: Path | None = None):
    from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from tools.make_tiny_checkpoints import build_tokenizer

    ckpt = str(tiny_checkpoint(case, spec, tiny_dir or tmp / "tiny")) if tiny else None
    if case == "oft_lora":
        if tiny:
            cfg = OpenVLAOFTPolicyConfig(checkpoint=ckpt, device=device, lora_rank=4)
        else:
            cfg = OpenVLAOFTPolicyConfig(tokenizer=str(build_tokenizer(tmp / "oft_tok", kind="llama",
                                                                       vocab_size=2000)), device=device)
        return OpenVLAOFTPolicy(cfg, spec)
    full = case == "pi0_full"
    if tiny:
        cfg = Pi0PolicyConfig(checkpoint=ckpt, chunk_size=8, device=device,
                              lora_rank=0 if full else 4)
    else:
        cfg = Pi0PolicyConfig(tokenizer=str(build_tokenizer(tmp / "pi0_tok", kind="gemma")), device=device,
                              **({"lora_rank": 0} if full else {}))
    policy = Pi0Policy(cfg, spec)
    if full:
        for p in policy.parameters():
            p.requires_grad_(True)
    return policy


class BCStep:
    """``agents.rs.agent.BCLoss`` (the policy's ``bc_loss`` as the prepared module's
    forward); with ``autocast`` its forward runs under the same autocast as
    ``agents.ppo.agent.PolicyCalls`` (a DeepSpeed bf16 engine casts the weights to bf16 while the
    batch stays float32; a no-op for fp32 or CPU weights)."""

    @staticmethod
    def module(policy, autocast: bool):
        import torch

        from agents.rs.agent import BCLoss

        if not autocast:
            return BCLoss(policy)

        class AutocastBCLoss(BCLoss):
            def forward(self, batch):
                p = next(self.parameters(), None)
                low = p is not None and p.is_cuda and p.dtype in (torch.bfloat16, torch.float16)
                with torch.autocast("cuda", dtype=p.dtype if low else torch.bfloat16, enabled=low):
                    return self.policy.bc_loss(batch)

        return AutocastBCLoss(policy)


def micro_batches(policy, spec, n: int, micro: int, device, seed: int) -> list[dict]:
    """This rank's share of one global batch: ``n`` samples as micro-batches of ``micro``
    (random observations, tools/bench/common.random_obs; actions uniform in [-1, 1))."""
    import torch

    from tools.bench.common import random_obs

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n // micro):
        obs = random_obs(spec.state_dim, spec.cameras, micro, seed=seed * 1000 + i)
        b = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in obs.items()}
        b["task"] = [TASK] * micro
        b["action"] = (torch.rand(micro, policy.chunk_size, spec.action_dim, generator=g) * 2 - 1).to(device)
        out.append(b)
    return out


def _err(phase: str, exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    kind = "out of memory" if "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError" \
        else type(exc).__name__
    return f"{phase}: {kind}: {first}"


def _gather(obj: Any, world: int) -> list:
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def run(args, spec) -> dict | None:
    """One benchmark run on this rank; rank 0 returns the result dict (others None)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from datetime import timedelta

    from agents.parallel import accelerator_kwargs, is_zero3, uses_deepspeed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank, rem = divmod(args.global_batch, world)
    if rem or per_rank % args.micro_batch:
        raise ValueError(f"global batch {args.global_batch} must split into {world} ranks x whole "
                         f"micro-batches of {args.micro_batch}")
    accum = per_rank // args.micro_batch
    tmp = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    ds_cfg = patch_deepspeed_config(accum, args.micro_batch, tmp)
    acc = Accelerator(cpu=args.cpu, gradient_accumulation_steps=accum, kwargs_handlers=accelerator_kwargs() + [
        InitProcessGroupKwargs(timeout=timedelta(seconds=float(args.timeout_s)))])
    rank, world = acc.process_index, acc.num_processes
    dev = acc.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    zero = int(acc.state.deepspeed_plugin.zero_stage) if uses_deepspeed(acc) else 0
    res: dict = {"case": args.case, "world": world, "deepspeed_zero_stage": zero,
                 "mode": f"zero{zero}" if zero else ("ddp" if world > 1 else "single"),
                 "global_batch": args.global_batch, "per_rank_batch": per_rank, "micro_batch": args.micro_batch,
                 "accum_steps": accum, "warmup_steps": args.warmup, "timed_steps": args.steps,
                 "tiny": args.tiny, "image_size": args.image_size, "autocast": not args.no_autocast,
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                 "error": None}
    if ds_cfg is not None:
        res["deepspeed_config"] = {"source": os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                                   "gradient_accumulation_steps": accum, "bf16": ds_cfg.get("bf16", {}).get("enabled")}
    torch.manual_seed(0)
    if args.cpu and args.threads:
        torch.set_num_threads(args.threads)
    state: dict = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    def phase_build():
        t0 = time.perf_counter()
        state["policy"] = build_policy(args.case, args.tiny, str(dev), tmp, spec,
                                       Path(args.tiny_dir) if args.tiny_dir else None)
        res["build_s"] = time.perf_counter() - t0
        pol = state["policy"]
        res["params_m"] = sum(p.numel() for p in pol.parameters()) / 1e6
        res["trainable_params_m"] = sum(p.numel() for p in pol.parameters() if p.requires_grad) / 1e6
        res["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in pol.parameters()})
        if cuda:  # the training peak below starts after the build
            res["build_peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            torch.cuda.reset_peak_memory_stats(dev)

    def phase_prepare():
        pol = state["policy"]
        pol.train()
        params = [p for p in pol.parameters() if p.requires_grad]
        fused = dev.type in ("cpu", "cuda") and not uses_deepspeed(acc)
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=fused)
        state["model"], state["opt"] = acc.prepare(BCStep.module(pol, not args.no_autocast), opt)
        state["params"] = params
        state["mbs"] = micro_batches(pol, spec, per_rank, args.micro_batch, dev, seed=rank + 1)
        res["zero3"] = is_zero3(acc)
        if args.fail_rank == rank:  # tests: the error path
            raise torch.OutOfMemoryError("CUDA out of memory (simulated by --fail-rank)")

    def one_step():
        model, opt = state["model"], state["opt"]
        losses = []
        for mb in state["mbs"]:
            with acc.accumulate(model):
                loss = model(mb)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(state["params"], 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses

    def phase_steps():
        times = []
        for i in range(args.warmup + args.steps):
            acc.wait_for_everyone()
            sync()
            t0 = time.perf_counter()
            losses = one_step()
            sync()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
            if i == 0:
                res["first_loss"] = float(torch.stack(losses).float().mean())
            if rank == 0 and args.verbose:
                print(f"[bench_scaling] step {i} {'(warm-up) ' if i < args.warmup else ''}{dt * 1e3:.1f} ms",
                      flush=True)
        res["last_loss"] = float(torch.stack(losses).float().mean())
        state["times"] = times

    for name, fn in (("build", phase_build), ("prepare", phase_prepare), ("steps", phase_steps)):
        try:
            fn()
            err = None
        except Exception as exc:  # noqa: BLE001 (recorded, then every rank stops together)
            err = _err(name, exc)
            if cuda:
                state.clear()
                torch.cuda.empty_cache()
        if err:  # recorded before the ranks agree on it: a peer may be stuck in a collective
            if rank == 0:
                res["error"] = err
                write_json(res, args.json)
            elif args.json:
                Path(f"{args.json}.rank{rank}.error").write_text(err)
        errs = _gather(err, world)
        if any(errs):
            res["error"] = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errs) if e)
            break
    times = state.get("times") or []
    mem = {"peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
           "peak_reserved_gb": torch.cuda.max_memory_reserved(dev) / 1e9} if cuda else {}
    if times:
        med = float(np.median(times))
        mem["step_s_p50"] = med
    per_rank_stats = _gather(mem, world)  # every rank is here: the phases' gathers kept them together
    if rank == 0:
        res["per_rank"] = per_rank_stats
        if cuda:
            res["peak_gb_max"] = max(m.get("peak_gb", 0.0) for m in per_rank_stats)
        if times:
            med = float(np.median(times))
            res.update(step_s_p50=med, step_s_min=min(times), step_s_max=max(times),
                       step_s_all=[round(t, 5) for t in times], samples_per_s=args.global_batch / med)
    state.clear()
    return res if rank == 0 else None


def write_json(res: dict, path: str | None) -> None:
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(path)
