"""The parts of :mod:`tools.bench.train_serve` that run beside its phases: the training copy's
update loop (:class:`Trainer`: rejection sampling's BC step or a GRPO update round), the sleep
probe of time spent waiting to run (:class:`GilProbe`) and the per-stream kernel time of a
profiler trace (:func:`stream_overlap`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from tools.bench.common import p50_p99, random_obs
from tools.bench.policy_actors import TASK

class GilProbe(threading.Thread):
    """Sleeps ``sleep_s`` in a loop and records how far past it each wake-up came (ms)."""

    def __init__(self, sleep_s: float = 0.0005):
        super().__init__(name="gil-probe", daemon=True)
        self.sleep_s, self.late_ms, self._stop_ev = sleep_s, [], threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        self._t0 = time.perf_counter()
        while not self._stop_ev.is_set():
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)
            self.late_ms.append((time.perf_counter() - t0 - self.sleep_s) * 1000.0)

    def finish(self) -> dict:
        self._stop_ev.set()
        self.join(5)
        x = np.asarray(self.late_ms or [0.0])
        wall = max(1e-9, time.perf_counter() - self._t0)
        return {"n": int(x.size), "p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
                "mean": float(x.mean()), "waited_s_per_s": float(x.sum() / 1000.0 / wall)}


#: --update: what one training step is (auto: grpo for openvla_oft_discrete, else bc)
UPDATES = ("bc", "grpo")


def update_for(policy: str, update: str) -> str:
    """``--update`` for one policy: ``auto`` is GRPO's update for the discrete OFT (GRPO's
    policy) and rejection sampling's BC step for the others."""
    if update == "auto":
        return "grpo" if policy == "openvla_oft_discrete" else "bc"
    return update


class Trainer:
    """The training copy's update loop on a fixed random batch, a new weights version every
    ``publish_every`` steps. ``update="bc"``: one ``bc_loss`` step with AdamW (rejection
    sampling's update). ``update="grpo"``: one :meth:`agents.grpo.agent.GRPOAgent.update` round
    (GRPO's defaults, one epoch over the batch: the proximal log-probs without gradients, then per
    ``minibatch`` chunks the clipped surrogate's forward, backward and optimizer step) over chunks
    sampled from the policy with advantages of +1 and -1."""

    def __init__(self, policy, spec, batch: int, publish, publish_every: int, sync, update: str = "bc",
                 minibatch: int = 8):
        import torch

        if update not in UPDATES:
            raise ValueError(f"train_serve: --update must be one of {UPDATES}, got {update!r}")
        self.policy, self.publish, self.publish_every, self.sync = policy, publish, publish_every, sync
        self.update = update
        policy.train()
        ob = random_obs(spec.state_dim, spec.cameras, seed=1)
        dev = next(policy.parameters()).device
        self.batch = {k: torch.from_numpy(np.repeat(v, batch, axis=0)).to(dev) for k, v in ob.items()}
        self.batch["task"] = [TASK] * batch
        if update == "grpo":
            self.agent = grpo_agent(policy, self.batch, batch, dev, min(minibatch, batch))
        else:
            self.opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
            self.batch["action"] = (torch.rand(batch, policy.chunk_size, spec.action_dim) * 2 - 1).to(dev)
        self.updates = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        if self.update == "grpo":
            self.agent.update(self.batch)
        else:
            self.opt.zero_grad(set_to_none=True)
            self.policy.bc_loss(self.batch).backward()
            self.opt.step()
        self.updates += 1
        if self.updates % self.publish_every == 0:
            self.publish(self.policy.trainable_state_dict())
        self.sync()
        return (time.perf_counter() - t0) * 1000.0

    def run_until(self, done: threading.Event | None = None, seconds: float | None = None) -> dict:
        steps, t0 = [], time.perf_counter()
        while not (done.is_set() if done is not None else time.perf_counter() - t0 >= seconds):
            steps.append(self.step())
        wall = time.perf_counter() - t0
        return {"updates": len(steps), "updates_per_s": len(steps) / wall, "step_ms": p50_p99(steps or [0.0]),
                "wall_s": wall}


def grpo_agent(policy, batch: dict, n: int, device, minibatch: int):
    """A GRPO agent over ``policy`` and ``batch`` completed in place as GRPO's rollout batch:
    chunks the policy samples for its observations, their behaviour log-probs, advantages
    alternating +1 / -1 (a group's successes and failures), every chunk executed."""
    import torch
    from accelerate import Accelerator

    from agents.grpo.agent import GRPOAgent, GRPOConfig

    agent = GRPOAgent(GRPOConfig(epochs=1, minibatch_size=minibatch, lr=1e-5), policy,
                      Accelerator(cpu=device.type != "cuda"))
    obs = dict(batch)  # the observation, before the rollout keys join the batch
    with torch.no_grad():
        out = policy.act(obs, deterministic=False)
        batch["action"] = out.actions.to(device)
        batch["old_log_prob"] = policy.log_prob(obs, batch["action"]).float()
    batch["advantages"] = torch.tensor([1.0, -1.0], device=device).repeat((n + 1) // 2)[:n]
    batch["mask"] = torch.ones(n, device=device)
    return agent


def stream_overlap(trace: dict) -> dict:
    """GPU kernel time per stream and the seconds kernels of two or more streams ran at once,
    from a chrome trace (torch.profiler's export: kernel events carry ``args.stream``)."""
    by: dict[str, list[tuple[float, float]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            s = str(ev.get("args", {}).get("stream"))
            by.setdefault(s, []).append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))))
    edges = []
    busy = {}
    for s, iv in by.items():
        merged = []
        for a, b in sorted(iv):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        busy[s] = sum(b - a for a, b in merged) / 1e6
        edges += [(a, 1) for a, _ in merged] + [(b, -1) for _, b in merged]
    overlap, depth, last = 0.0, 0, None
    for t, d in sorted(edges, key=lambda e: (e[0], e[1])):
        if depth >= 2 and last is not None:
            overlap += t - last
        depth, last = depth + d, t
    return {"kernel_s_by_stream": busy, "overlap_s": overlap / 1e6, "streams": len(busy)}
