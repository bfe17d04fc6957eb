"""PI0 / PI0.5 with a tractable likelihood (πRL, RLinf): Flow-Noise and Flow-SDE, a value
head and a LoRA-disabled reference, so that PPO (:mod:`agents.ppo.agent`) can train a flow policy.

``policy=pi0`` (or ``pi05``) with ``policy.flow_rl=noise|sde`` builds :class:`Pi0FlowRLPolicy`
(:func:`class_for_config`, which the registry asks); ``flow_rl=null`` is plain PI0.

The chain. lerobot's PI0 integrates x from t = 1 (noise x_0) to t = 0 in K Euler steps,
dt = -1/K, t_k = 1 + k dt: x_{k+1} = x_k + dt v(x_k, t_k). Here every step is a Gaussian
x_{k+1} ~ N(mu_k, std_k^2) on the *real* action dims (the first ``action_dim`` of lerobot's
``max_action_dim``; the padding dims follow the ODE, the env never sees them):

- **Flow-Noise** (``noise``): mu_k = x_k + dt v(x_k, t_k), std_k = the noise head (an MLP on
  the expert's features of the chunk's action tokens at step k, per token and dim, bounded to
  [noise_std_min, noise_std_max] by a sigmoid in log space). log pi(chunk) is the joint
  log-density of the chain: sum over the K steps, H tokens and A dims (the initial noise's
  density is left out: it does not depend on the weights, so ratios and KLs are unchanged).
  The noise head is dropped at deployment: ``act(deterministic=True)`` is the plain ODE.
- **Flow-SDE** (``sde``): the ODE as the marginal-preserving reverse SDE of Flow-GRPO,
  mu_k = x_k + dt [v + sigma^2 / (2t) (x_k + (1 - t) v)], std_k = sigma sqrt(-dt), sigma_t =
  a sqrt(t / (1 - t)) (a = ``sde_noise_level``), with t clamped to at most 1 + dt / 2 in these
  terms (sigma is infinite at t = 1). One step k* per chunk, drawn uniformly, is sampled from
  it; the others are ODE steps. log pi(chunk) = log N(x_{k*+1}; mu_k*, std_k*^2).

The chain's start. lerobot draws x_0 ~ N(0, I); here x_0 ~ ``init_noise_scale`` * N(0, I).
x_0's density does not depend on the weights, so it is left out of log pi, and whatever part of
the action's spread x_0 causes is invisible to the policy gradient. A weakly trained flow passes
most of x_0 through to the action (a tiny PI0 after 100 BC steps: action std 0.46 from x_0 with
the step noise off, 0.10 from the step noise with x_0 fixed), so success then correlates mostly
with x_0 and the chain's Gaussians see little of it. ``init_noise_scale: 0`` starts every chain
at 0 (the deterministic act's start): all of the randomness is then in the Gaussians that log pi
counts, and the policy trained is the one deployed.

Extras (``extras_spec``; they ride on the act reply into every step's record as
``extra.<name>``): ``noise`` [H, D] (x_0, as plain PI0), ``chain`` [K+1, H, D] (x_0 .. x_K,
D = max_action_dim), ``log_prob`` [] and, for SDE, ``sde_step`` [1] (k*). Deterministic acts
carry the ODE chain, k* = 0 and the log-density of that chain under the stochastic policy.

Acting. The chain's randomness is drawn first (x_0, then k*, then each step's standard normals,
or taken from ``act``'s ``noise`` / ``step_noise`` / ``sde_step``) and every Euler step is
:meth:`_chain_step`. In eval mode without gradients, where ``fast_serving`` gives a fast path
(:meth:`Pi0Policy._fast_sampler`, the rule of plain PI0's act: ``auto`` on a GPU, ``graphs``,
``eager``), the chain runs on :class:`agents.policies.pi0.fast_chain.FastPiChainSampler`: the prefix
once, the expert's steps on the fast path's kernels, on a GPU one CUDA graph per batch bucket and
deterministic / stochastic act; otherwise eagerly through lerobot's modules. On a CPU the two
agree to float32 round-off (tests/test_flow_rl_fast.py); on a GPU within bf16 / TF32 tolerance.
``warm_up`` captures both acts' graphs of the warm-up buckets.

Update time: :meth:`log_prob` reads ``obs["extra.chain"]`` (and ``extra.sde_step``), which the
on-policy batches carry for each chunk (:func:`agents.ppo.on_policy.chunk_batch`), and recomputes
the same Gaussians with the current weights: one prefix pass, then K expert passes (Flow-Noise)
or one (Flow-SDE, at each row's own t_k*). The ``actions`` argument only sets the batch size:
the chain, not the clipped env actions, is what was sampled. With the same weights the act's
log-prob and this one agree (tests/test_flow_rl.py): exactly in eval mode without gradients
when the act ran eagerly (both run lerobot's modules with the LoRA folded), to round-off
otherwise (the fast path's kernels; training mode's unfolded adapters).

:meth:`value` (ValuePolicy): an MLP on mean-pooled features (``value_features``: the expert's
action tokens at t = 1 from x = 0, or the VLM's prefix), detached by default
(``value_detach``: the value loss trains the head only). :meth:`reference` (ReferencePolicy):
the same model with its adapters and fully trained heads (action projections, noise head)
swapped for their values at construction, where LoRA B = 0 (the model without adapters), or at
:meth:`mark_reference` (the SFT start ``policy.init_trainable`` loaded): a host-memory copy of the
trained parameters, no second model.

The weights sync to actors (``trainable_state_dict``) adds the noise head (``flow_rl.noise.*``);
the value head stays on the learner.

The recipe that learns on a tiny PI0 (chains from x_0 = 0, a step std held at 0.3, LoRA 8) is
``python -m tools.experiments.flow_ppo_demo``'s; with a small step std a weak policy's outcome
hardly depends on its sampled chain, so the advantages say little about the action. Results:
docs/learning.md.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from agents.base import ActionChunk, Batch
from agents.policies import vla_common as vc
from agents.policies.pi0.fast_chain import FastPiChainSampler
from agents.policies.pi0.policy import Pi0Policy, Pi05Policy
from agents.policies.pi0.flow_rl_config import FLOW_RL_MODES, VALUE_FEATURES, validate_flow_config  # noqa: F401
from agents.policies.pi0.lerobot_modules import lerobot_pi_module
from data.core.schema import EXTRA_PREFIX

_LOG_2PI = math.log(2 * math.pi)


def flow_rl_class(base: type, mode: Any) -> type:
    """The flow-RL class for ``base`` (Pi0Policy or Pi05Policy); a bad mode is named."""
    if mode not in FLOW_RL_MODES:
        raise ValueError(f"policy={'pi05' if issubclass(base, Pi05Policy) else 'pi0'}: flow_rl must be "
                         f"null (plain PI0), 'noise' (Flow-Noise) or 'sde' (Flow-SDE), got {mode!r}")
    return Pi05FlowRLPolicy if issubclass(base, Pi05Policy) else Pi0FlowRLPolicy


def class_for_config(base: type, values) -> type:
    """The class a ``policy=pi0|pi05`` config section builds (:func:`agents.registry.policy_class`):
    with ``flow_rl`` set, the flow-RL policy of this module, else ``base``."""
    mode = dict(values or {}).get("flow_rl")
    return base if mode is None else flow_rl_class(base, mode)


class FlowHeads(nn.Module):
    """The noise head (Flow-Noise only): expert features [..., E] -> log std [..., A] in
    [log std_min, log std_max]; the value head: pooled features [B, F] -> [B]."""

    def __init__(self, cfg, expert_width: int, value_width: int, action_dim: int):
        super().__init__()
        self.log_min, self.log_max = math.log(cfg.noise_std_min), math.log(cfg.noise_std_max)
        self.noise = None
        if cfg.flow_rl == "noise":
            h = int(cfg.noise_head_hidden)
            self.noise = nn.Sequential(nn.Linear(expert_width, h), nn.Tanh(), nn.Linear(h, action_dim))
            nn.init.normal_(self.noise[-1].weight, std=1e-3)  # start near the geometric mid std
            nn.init.zeros_(self.noise[-1].bias)
        h = int(cfg.value_hidden)
        self.value = nn.Sequential(nn.Linear(value_width, h), nn.Tanh(), nn.Linear(h, 1))

    def noise_std(self, feat: torch.Tensor) -> torch.Tensor:
        raw = self.noise(feat.float())
        return (self.log_min + (self.log_max - self.log_min) * torch.sigmoid(raw)).exp()


class _FlowRL:
    """Flow-Noise / Flow-SDE on top of :class:`Pi0Policy` (see the module docstring)."""

    #: the fast path builds the chain sampler (plain PI0's ``sample`` is on it too)
    _fast_class = FastPiChainSampler
    #: ``warm_up`` captures both acts' graphs: deterministic (eval) and stochastic (rollouts)
    _warm_acts = (True, False)

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        validate_flow_config(cfg)
        self.mode = cfg.flow_rl
        self.who = f"{self.who} flow_rl={self.mode}"
        self.num_steps = int(cfg.num_inference_steps)
        self.max_dim = int(self.lr_cfg.max_action_dim)
        m = self.inner.model
        expert_w = m.action_out_proj.in_features
        value_w = expert_w if cfg.value_features == "expert" else int(self.arch.width)
        self.heads = FlowHeads(cfg, expert_w, value_w, self.action_dim).to(self.device)
        self._mod = lerobot_pi_module(self.variant)
        # the KL reference: adapters, action heads and noise head as they are now (LoRA B = 0)
        self._reference = vc.ReferenceSnapshot(self, self.lora, skip=("heads.value.",))

    # -- the model, step by step ------------------------------------------------------------------
    def _wdtype(self) -> torch.dtype:
        return self.inner.model.paligemma_with_expert.paligemma.model.language_model.layers[0].self_attn.q_proj.weight.dtype

    def _context(self, inputs: tuple) -> dict:
        """The prefix pass (images + language): its features, pad mask and KV cache."""
        m, mod = self.inner.model, self._mod
        embs, pad, att = m.embed_prefix(*inputs[:4])
        if self._wdtype() == torch.bfloat16:
            embs = embs.to(torch.bfloat16)
        att4 = mod.prepare_attention_masks_4d(mod.make_att_2d_masks(pad, att))
        m.paligemma_with_expert.paligemma.model.language_model.config._attn_implementation = "eager"  # noqa: SLF001
        (out, _), kv = m.paligemma_with_expert.forward(attention_mask=att4, position_ids=torch.cumsum(pad, 1) - 1,
                                                       past_key_values=None, inputs_embeds=[embs, None], use_cache=True)
        return {"prefix": out, "pad": pad, "kv": kv, "state": inputs[4] if len(inputs) > 4 else None}

    def _velocity(self, ctx: dict, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """lerobot's ``denoise_step`` returning also the expert's action-token features:
        x [B, H, D], t [B] -> (v [B, H, D], features [B, H, E]) in float32."""
        m, mod = self.inner.model, self._mod
        suffix = m.embed_suffix(ctx["state"], x, t) if self.variant == "pi0" else m.embed_suffix(x, t)
        embs, spad, satt, ada = suffix
        if self._wdtype() == torch.bfloat16:
            embs = embs.to(torch.bfloat16)
        pad = ctx["pad"]
        b, ls, lp = pad.shape[0], spad.shape[1], pad.shape[1]
        full = torch.cat([pad[:, None, :].expand(b, ls, lp), mod.make_att_2d_masks(spad, satt)], dim=2)
        pos = pad.sum(-1)[:, None] + torch.cumsum(spad, dim=1) - 1
        m.paligemma_with_expert.gemma_expert.model.config._attn_implementation = "eager"  # noqa: SLF001
        outs, _ = m.paligemma_with_expert.forward(
            attention_mask=mod.prepare_attention_masks_4d(full), position_ids=pos,
            past_key_values=mod.clone_past_key_values(ctx["kv"]), inputs_embeds=[None, embs], use_cache=False,
            adarms_cond=[None, ada])
        feat = outs[1][:, -self.chunk_size:].float()
        return m.action_out_proj(feat).float(), feat

    def _gaussian(self, x, v, feat, t) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std of x_{k+1} on the real action dims: ([B, H, A], [B, H, A])."""
        a, dt = self.action_dim, -1.0 / self.num_steps
        x, v = x[..., :a], v[..., :a]
        if self.mode == "noise":
            return x + dt * v, self.heads.noise_std(feat)
        tc = t.clamp(max=1.0 + dt / 2)[:, None, None]
        sigma = self.cfg.sde_noise_level * torch.sqrt(tc / (1 - tc))
        mean = x + dt * (v + sigma.pow(2) / (2 * tc) * (x + (1 - tc) * v))
        return mean, (sigma * math.sqrt(-dt)).expand_as(mean)

    @staticmethod
    def _log_normal_terms(y, mean, std) -> torch.Tensor:
        """log N(y; mean, std^2) summed over each action's dims -> [B, H]."""
        z = (y - mean) / std
        return (-0.5 * z.pow(2) - std.log() - 0.5 * _LOG_2PI).sum(-1)

    @classmethod
    def _log_normal(cls, y, mean, std) -> torch.Tensor:
        """Sum over tokens and dims of log N(y; mean, std^2) -> [B]."""
        return cls._log_normal_terms(y, mean, std).sum(-1)

    def _time(self, k, b: int) -> torch.Tensor:
        k = torch.as_tensor(k, device=self.device, dtype=torch.float32)
        return (1.0 - k / self.num_steps).expand(b) if k.ndim == 0 else 1.0 - k / self.num_steps

    def _chain_step(self, k: int, x, v, feat, t, eps, k_star) -> tuple[torch.Tensor, torch.Tensor]:
        """Euler step ``k`` of an act's chain: (x_{k+1} [B, H, D], its log-density term [B]).
        ``eps`` [B, H, A]: the step's standard normals (None: deterministic, the ODE step);
        ``k_star`` [B]: Flow-SDE's stochastic step (Flow-Noise: every step is). The eager act and
        the fast path (:meth:`FastPiChainSampler.chain`) both run it."""
        a, dt = self.action_dim, -1.0 / self.num_steps
        mean, std = self._gaussian(x, v, feat, t)
        nxt = x + dt * v
        here = torch.ones_like(k_star, dtype=torch.bool) if self.mode == "noise" else k_star == k
        if eps is not None:
            real = mean + std * eps
            nxt = torch.cat([torch.where(here[:, None, None], real, nxt[..., :a]), nxt[..., a:]], -1)
        return nxt, torch.where(here, self._log_normal(nxt[..., :a], mean, std), 0.0)

    # -- acting -------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False, noise: torch.Tensor | None = None,
            step_noise: torch.Tensor | None = None, sde_step: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> ActionChunk:
        """Actions [B, H, A]; ``log_prob`` [B] of the chain; extras in the module docstring.
        ``noise`` [B, H, D] overrides x_0 (deterministic: zeros, then the plain ODE). Stochastic
        acts only: ``step_noise`` [B, K, H, A] overrides the chain's standard normals (Flow-SDE
        reads those of its step k*), ``sde_step`` [B] Flow-SDE's k*; otherwise they are drawn
        with torch on the policy's device (x_0, k*, then each step's, in that order), from
        ``generator`` when given, else from torch's global RNG. In eval mode
        without gradients the chain runs on the fast path where ``fast_serving`` gives one
        (:meth:`_fast_sampler`, as plain PI0's act), else eagerly through lerobot's modules."""
        self._serving_weights()
        inputs = self.model_inputs(obs)
        b, dev, steps = inputs[2].shape[0], self.device, self.num_steps
        shape = (b, self.chunk_size, self.max_dim)
        if noise is None:
            noise = (torch.zeros(shape, device=dev) if deterministic
                     else float(self.cfg.init_noise_scale) * torch.randn(shape, device=dev, generator=generator))
        noise = noise.to(dev, torch.float32)
        k_star, eps = torch.zeros(b, dtype=torch.long, device=dev), None
        if not deterministic:
            if self.mode == "sde":
                k_star = (torch.randint(0, steps, (b,), device=dev, generator=generator) if sde_step is None
                          else torch.as_tensor(sde_step).to(dev, torch.long).reshape(b))
                if sde_step is not None and bool(((k_star < 0) | (k_star >= steps)).any()):
                    raise ValueError(f"{self.who}: sde_step outside 0..{steps - 1}")
            want = (b, steps, self.chunk_size, self.action_dim)
            # one draw per step, as the chain used to draw them step by step (the same stream)
            eps = (torch.stack([torch.randn((b, *want[2:]), device=dev, generator=generator) for _ in range(steps)], 1)
                   if step_noise is None else torch.as_tensor(step_noise).to(dev, torch.float32))
            if tuple(eps.shape) != want:
                raise ValueError(f"{self.who}: step_noise must be {list(want)}, got {list(eps.shape)}")
        fast = self._fast_sampler()
        if fast is not None:
            images, img_masks, toks, masks = inputs[:4]
            x, logp, chain, k_star = fast.chain(images, img_masks, toks, masks, inputs[4] if len(inputs) > 4 else None,
                                                noise, steps, self._chain_step, eps=eps, k_star=k_star,
                                                key=(self.mode, self.lora.folded))
        else:
            x, logp, chain = self._eager_chain(inputs, noise, eps, k_star)
        extras = {"noise": noise, "chain": chain}
        if self.mode == "sde":
            extras["sde_step"] = k_star[:, None]
        return ActionChunk(self._postprocess(x), logp, extras)

    def _eager_chain(self, inputs: tuple, x: torch.Tensor, eps, k_star) -> tuple[torch.Tensor, ...]:
        """The act's chain through lerobot's modules: (x_K, log_prob [B], chain [B, K+1, H, D])."""
        ctx = self._context(inputs)
        chain, logp = [x], torch.zeros(x.shape[0], device=x.device)
        for k in range(self.num_steps):
            t = self._time(k, x.shape[0])
            v, feat = self._velocity(ctx, x, t)
            x, term = self._chain_step(k, x, v, feat, t, None if eps is None else eps[:, k], k_star)
            logp = logp + term
            chain.append(x)
        return x, logp, torch.stack(chain, 1)

    def extras_spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        spec = {"noise": ("float32", (self.chunk_size, self.max_dim)),
                "chain": ("float32", (self.num_steps + 1, self.chunk_size, self.max_dim)),
                "log_prob": ("float32", ())}
        if self.mode == "sde":
            spec["sde_step"] = ("int64", (1,))
        return spec

    def extras_ranges(self) -> dict[str, tuple[int, int]]:
        """Ingest refuses an SDE step outside the chain (an update would index with it)."""
        return {"sde_step": (0, self.num_steps - 1)} if self.mode == "sde" else {}

    # -- update time ----------------------------------------------------------------------------------
    def _extra(self, obs: Batch, name: str, b: int) -> torch.Tensor:
        key = EXTRA_PREFIX + name
        if key not in obs:
            raise ValueError(f"{self.who}: log_prob needs each chunk's {key!r} (the act's denoising path); "
                             f"the batch has {sorted(k for k in obs if k.startswith(EXTRA_PREFIX))}")
        v = torch.as_tensor(obs[key]).to(self.device)
        if v.shape[0] != b:
            raise ValueError(f"{self.who}: {key!r} has {v.shape[0]} rows, the batch {b}")
        return v

    def token_chunk_positions(self, num_tokens: int) -> torch.Tensor:
        """Each of :meth:`token_log_prob`'s factors' action index in the chunk (step-major)."""
        if num_tokens % self.chunk_size:
            raise ValueError(f"{self.who}: {num_tokens} factors do not split into {self.chunk_size} actions")
        return torch.arange(num_tokens) % self.chunk_size

    def token_log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """The factors of :meth:`log_prob`: log N of each action of each stochastic step,
        [B, K * H] with Flow-Noise (step-major), [B, H] with Flow-SDE (its one step)."""
        b = int(actions.shape[0])
        chain = self._extra(obs, "chain", b).float()
        want = (b, self.num_steps + 1, self.chunk_size, self.max_dim)
        if tuple(chain.shape) != want:
            raise ValueError(f"{self.who}: extra.chain must be {list(want)}, got {list(chain.shape)}")
        self._serving_weights()
        ctx = self._context(self.model_inputs(obs))
        a = self.action_dim
        if self.mode == "noise":
            terms = []
            for k in range(self.num_steps):
                t = self._time(k, b)
                v, feat = self._velocity(ctx, chain[:, k], t)
                mean, std = self._gaussian(chain[:, k], v, feat, t)
                terms.append(self._log_normal_terms(chain[:, k + 1, ..., :a], mean, std))
            return torch.cat(terms, 1)
        k = self._extra(obs, "sde_step", b).long().reshape(b)
        if bool(((k < 0) | (k >= self.num_steps)).any()):
            raise ValueError(f"{self.who}: extra.sde_step outside 0..{self.num_steps - 1}")
        rows = torch.arange(b, device=self.device)
        x, t = chain[rows, k], self._time(k, b)
        v, feat = self._velocity(ctx, x, t)
        mean, std = self._gaussian(x, v, feat, t)
        return self._log_normal_terms(chain[rows, k + 1, ..., :a], mean, std)

    def log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """log pi [B] of each chunk's stored chain (``obs["extra.chain"]`` [B, K+1, H, D]) under
        the current weights; differentiable in them. ``actions`` [B, H, A]: batch size only."""
        return self.token_log_prob(obs, actions).sum(-1)

    def value(self, obs: Batch) -> torch.Tensor:
        """V(obs) [B] from the value head on pooled features (``value_features``)."""
        self._serving_weights()
        grad = contextlib.nullcontext() if not self.cfg.value_detach else torch.no_grad()
        with grad:
            ctx = self._context(self.model_inputs(obs))
            if self.cfg.value_features == "expert":
                b = ctx["pad"].shape[0]
                x = torch.zeros(b, self.chunk_size, self.max_dim, device=self.device)
                f = self._velocity(ctx, x, self._time(0, b))[1].mean(1)
            else:
                m = ctx["pad"].float()[..., None]
                f = (ctx["prefix"].float() * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.heads.value(f.float()).squeeze(-1)

    def value_parameters(self) -> list[nn.Parameter]:
        """The value head's parameters (PPO trains them at its value_lr)."""
        return list(self.heads.value.parameters())

    def reference(self):
        """The reference policy: adapters, action heads and noise head at their values at
        construction (LoRA B = 0: the model without adapters) or at :meth:`mark_reference`."""
        return self._reference.swapped()

    def mark_reference(self) -> None:
        """The current adapters and heads become the reference (after an SFT start is loaded)."""
        self._reference.take()

    # -- weights ------------------------------------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Adapters + heads (:class:`Pi0Policy`) and the noise head as ``flow_rl.noise.*``."""
        out = super().trainable_state_dict()
        if self.heads.noise is not None:
            out.update({f"flow_rl.noise.{k}": v.detach().to("cpu", copy=True)
                        for k, v in self.heads.noise.state_dict().items()})
        return out

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = {k[len("flow_rl.noise."):]: v for k, v in state.items() if k.startswith("flow_rl.noise.")}
        if self.heads.noise is not None:
            try:
                self.heads.noise.load_state_dict(mine)
            except RuntimeError as exc:
                raise ValueError(f"{self.who}: the noise head in the trainable state does not fit: {exc}") from exc
        elif mine:
            raise ValueError(f"{self.who}: the trainable state has a noise head, this policy has none")
        super().load_trainable_state_dict({k: v for k, v in state.items() if not k.startswith("flow_rl.")})


class Pi0FlowRLPolicy(_FlowRL, Pi0Policy):
    """PI0 with Flow-Noise or Flow-SDE (module docstring)."""


class Pi05FlowRLPolicy(_FlowRL, Pi05Policy):
    """PI0.5 with Flow-Noise or Flow-SDE (module docstring)."""
