"""The flow-RL chain (:mod:`agents.policies.pi0.flow_rl`: Flow-Noise, Flow-SDE) on PI0's fast
serving path (:mod:`agents.policies.pi0.fast`).

:meth:`FastPiChainSampler.chain` runs what :meth:`FastPiSampler.sample` runs (the prefix once into
the KV stand-in, device-side masks and times, SDPA / grouped-head attention, PI0.5's modulations
for every step at once) and K Euler steps, but each step's velocity comes with the expert's
action-token features (``h[:, -chunk:]`` in float32, what ``action_out_proj`` reads) and the step
itself is the policy's: a callable ``step(k, x, v, feat, t, eps, k_star) -> (x_next, log_prob_k)``
(:meth:`agents.policies.pi0.flow_rl._FlowRL._chain_step`: the Gaussian of x_{k+1} on the real
action dims, Flow-Noise's std from the noise head), so the step's maths lives in one place and runs
the same on both paths. The chain's randomness comes in as inputs, never drawn inside: x_0
(``noise`` [B, H, D]), the per-step standard normals ``eps`` [B, K, H, A] (None: a deterministic
chain, the plain ODE) and Flow-SDE's stochastic step ``k_star`` [B]. Out: x_K [B, H, D], the chain's
log-density [B] (the sum of the steps' terms), the chain x_0 .. x_K [B, K+1, H, D] and k_star.

On a GPU (``graphs``) the whole call is one CUDA graph per (batch bucket, ``key``, deterministic or
not, input signature), through :meth:`FastPiSampler._graphed`: the same static buffers, padding to
the next bucket and memory pool as the plain sampler. ``key`` must name what changes the step
rule (the flow-RL mode) and the modules run (the adapter fold state). The step rule's parameters
(the noise head's) are read in place like the model's, so new weights need no recapture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agents.policies.fast_common import gpu_kernels
from agents.policies.pi0.fast import FastPiSampler

#: ``step(k, x [B, H, D], v [B, H, D], feat [B, H, E], t [B], eps [B, H, A] or None, k_star [B])
#: -> (x_{k+1} [B, H, D], log-density term [B])``
ChainStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class FastPiChainSampler(FastPiSampler):
    """:class:`FastPiSampler` (``sample`` serves plain PI0's acts unchanged) with :meth:`chain`,
    the flow-RL act's denoising chain (module docstring)."""

    @torch.no_grad()
    def chain(self, images, img_masks, tokens, lang_masks, state, noise: torch.Tensor, num_steps: int,
              step: ChainStep, *, eps: torch.Tensor | None, k_star: torch.Tensor,
              key: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_K [B, H, D], log_prob [B], chain [B, K+1, H, D], k_star [B]) of the chain from
        ``noise`` (x_0, float32) under ``step``; ``eps`` [B, K, H, A] the step noise (None:
        deterministic), ``k_star`` [B] (int64) Flow-SDE's stochastic step (zeros otherwise)."""
        b = noise.shape[0]
        if eps is not None and (eps.dim() != 4 or eps.shape[:2] != (b, num_steps)):
            raise ValueError(f"chain: eps must be [{b}, {num_steps}, H, A], got {list(eps.shape)}")
        if tuple(k_star.shape) != (b,):
            raise ValueError(f"chain: k_star must be [{b}], got {list(k_star.shape)}")
        inputs = {"images": list(images), "img_masks": list(img_masks), "tokens": tokens, "lang_masks": lang_masks,
                  "state": state, "noise": noise, "eps": eps, "k_star": k_star}
        self.sync_weights()

        def run(s: dict) -> tuple[torch.Tensor, ...]:
            return self._chain(s, num_steps, step)

        if not (self.graphs and noise.is_cuda) or self.bucket(b) is None:  # no graph: eager
            return run(inputs)
        det = eps is None
        what = f"flow-RL chain, {num_steps} steps, {'deterministic' if det else 'stochastic'}"
        return self._graphed(("chain", num_steps, key, det), inputs, run, what)

    def _chain(self, s: dict, num_steps: int, step: ChainStep) -> tuple[torch.Tensor, ...]:
        noise, eps, k_star, state = s["noise"], s["eps"], s["k_star"], s["state"]
        with gpu_kernels(noise.is_cuda):
            cache, pad, times, mods = self._steps(s["images"], s["img_masks"], s["tokens"], s["lang_masks"],
                                                  state, noise, num_steps)
            b = noise.shape[0]
            x, xs = noise, [noise]
            logp = torch.zeros(b, dtype=torch.float32, device=noise.device)
            for k in range(num_steps):
                v, feat = self._step_velocity(cache, pad, state, x, times, mods, k, features=True)
                x, term = step(k, x, v, feat, times[k].expand(b), None if eps is None else eps[:, k], k_star)
                logp = logp + term
                xs.append(x)
            return x, logp, torch.stack(xs, 1), k_star
