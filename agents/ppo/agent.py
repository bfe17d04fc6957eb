"""Proximal policy optimisation over whole action chunks, with an optional learned value.

``PPOAgent.update(batch)`` is a pure step over one round of rollouts: ``cfg.epochs`` passes
of shuffled minibatches of the clipped surrogate (asymmetric clip 1 - clip_low .. 1 +
clip_high, DAPO's clip-higher), optional clipped value loss, entropy bonus and KL penalty
to a reference, then returns float metrics. No files, sockets or logging inside.

The batch is flat per chunk (N chunks; observation keys as in :mod:`agents.base`):

    "action"          [N, H, A]  the executed chunk
    "old_log_prob"    [N]        behaviour log-prob (the records' ``extra.log_prob``)
    "advantages"      [N]        from :mod:`agents.common.advantages` (the builder computes them)
    "returns"         [N]        value targets (needed with a value function)
    optional: "old_values" [N], "ref_log_prob" [N], "is_weight" [N], "mask" [N] bool,
              "chunk_steps" [N] (env steps each chunk executed: token ratios of later actions are masked),
              "extra.<name>" [N, ...] (the chunk's policy extras; passed to the policy's calls)

Staleness (decoupled PPO, Hilton et al. 2021): rollouts may come from a policy version a few
updates old. With ``is_truncation`` set, the agent recomputes the log-probs of the current
weights once per batch ("proximal" policy), clips the ratio against those, and reweights each
sample by min(pi_prox / pi_behaviour, is_truncation). Without it, the ratio is taken against
the behaviour log-prob directly (classic PPO).

Ratios per chunk or per token (``ratio_level``): with a :class:`agents.base.TokenLogProbPolicy`
(``token_log_prob(obs, actions) -> [B, T]``, the factors of the chunk's likelihood) each token
gets its own clipped ratio against the proximal policy's, and the behaviour log-prob of the
records (per chunk) enters through the truncated importance weight only. Loss pieces are plain
functions in :mod:`agents.ppo.losses` (re-exported here), checked on known inputs.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from agents.common.advantages import masked_mean, masked_whiten
from agents import parallel
from agents.base import (Batch, ReferencePolicy, ReparamSampler, TokenLogProbPolicy,
                         ValuePolicy, check_pair, has_capability)
from agents.common.kl import kl_penalty
from agents.common.policy_calls import PolicyCalls, observation_keys, take, to_device
from agents.ppo.config import PPOConfig
from agents.ppo.losses import (entropy_bonus, per_token, policy_loss,  # noqa: F401 (re-exported)
                               truncated_is_weights, value_loss)

log = logging.getLogger("tandem.agents.ppo.agent")

# -- the agent ----------------------------------------------------------------------------------
def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _adam(module: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.Adam(_trainable(module), lr=lr, fused=device.type in ("cpu", "cuda"))


def _param_groups(policy: nn.Module, lr: float, value_lr: float) -> list[dict]:
    """A policy that holds its own value head (``value_parameters()``): that head at
    ``value_lr``, the rest at ``lr`` (a VLA's policy lr is far too small for a fresh head)."""
    head = [p for p in getattr(policy, "value_parameters", lambda: [])() if p.requires_grad]
    ids = {id(p) for p in head}
    groups = [{"params": [p for p in _trainable(policy) if id(p) not in ids], "lr": lr}]
    return groups + ([{"params": head, "lr": value_lr}] if head else [])


class PPOAgent:
    """PPO over a :class:`agents.base.LogProbPolicy` (``log_prob(obs, actions [B, H, A]) -> [B]``).

    ``value_fn`` is a module ``value_fn(obs) -> [B]`` trained with its own optimizer
    (``value_lr``), or the policy itself to train a :class:`agents.base.ValuePolicy`'s own value
    head with the policy's optimizer, or None for critic-free training (advantages from an
    outcome estimator; no value loss). Policy and value net go through ``accelerator.prepare``
    as one :class:`PolicyCalls` and every forward with a gradient runs through it (one per
    minibatch), so DDP all-reduces both; ``self.policy`` stays the unwrapped policy (what
    broadcasts read). With N ranks each holding a share of the round, advantages are whitened
    with the global statistics and each rank's loss is scaled so that the all-reduced gradient
    is the global masked mean's (:meth:`_whiten`, :func:`agents.parallel.rank_scale`). A reference policy is
    the same weights with adapters and heads at their start (``policy.reference()``), no copy.
    """

    name = "ppo"

    def __init__(self, cfg: PPOConfig, policy, value_fn: nn.Module | None, accelerator: Any):
        check_pair(self.name, cfg.requires, type(policy).__name__, policy)
        self.cfg = cfg
        self.accelerator = accelerator
        self.device = accelerator.device
        self.policy = policy
        self._value_in_policy = value_fn is policy
        if self._value_in_policy:
            check_pair(self.name, (ValuePolicy,), type(policy).__name__, policy)
        self.has_critic = value_fn is not None
        self._sampler = has_capability(policy, ReparamSampler)
        self._reference = has_capability(policy, ReferencePolicy)
        #: token-level ratios (PPOConfig.ratio_level)
        self.token_level = cfg.ratio_level == "token" or (
            cfg.ratio_level == "auto" and cfg.is_truncation is not None
            and has_capability(policy, TokenLogProbPolicy))
        self._lp_call = "token_log_prob" if self.token_level else "log_prob"
        log.info("%s: importance ratios per %s", self.name, "token" if self.token_level else "chunk")
        separate = self.has_critic and not self._value_in_policy
        calls = PolicyCalls(policy, value_fn if separate else None).to(self.device)
        self._value_raw = None
        if separate:
            # under an engine: one optimizer, the value net a second parameter group (its own
            # lr); gradient clipping is then the engine's, over both
            self._calls, self.opt, self.value_opt = parallel.prepare(
                accelerator, calls,
                lambda: [_adam(policy, cfg.lr, self.device), _adam(value_fn, cfg.value_lr, self.device)],
                engine_optimizer=lambda: torch.optim.AdamW(
                    [{"params": _trainable(policy), "lr": cfg.lr},
                     {"params": _trainable(value_fn), "lr": cfg.value_lr}], weight_decay=0.0),
                slots=2)
        else:  # a ValuePolicy's own head trains at value_lr (its own parameter group)
            groups = (_param_groups(policy, cfg.lr, cfg.value_lr) if self._value_in_policy
                      else [{"params": _trainable(policy), "lr": cfg.lr}])
            self._calls, self.opt, self.value_opt = parallel.prepare(
                accelerator, calls, lambda: [torch.optim.Adam(groups, fused=self.device.type in ("cpu", "cuda"))],
                slots=2)
        if separate:
            self._value_raw = value_fn
        #: the value net (unwrapped; no-gradient calls only) or None
        self.value_fn = self._value_raw
        self.num_updates = 0

    # -- forwards ---------------------------------------------------------------------------
    def _log_prob(self, obs: Batch, actions: torch.Tensor) -> torch.Tensor:
        """[B] per chunk, or [B, T] per token (``token_level``)."""
        lp = self._calls(obs, actions, what=self._lp_call).float()
        return lp.reshape(lp.shape[0], -1) if self.token_level else lp.reshape(-1)

    @staticmethod
    def _chunk_sum(logp: torch.Tensor) -> torch.Tensor:
        return logp.sum(-1) if logp.ndim == 2 else logp

    def _value(self, obs: Batch) -> torch.Tensor:
        return self._calls(obs, what="value").float().reshape(-1)

    def _whiten(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:func:`agents.common.advantages.masked_whiten` with the statistics of the *global* batch
        (all ranks' shares: :func:`agents.parallel.whiten_over_ranks`)."""
        if parallel.world(self.accelerator) == 1:
            return masked_whiten(adv, mask)
        return parallel.whiten_over_ranks(self.accelerator, adv, mask)

    @torch.no_grad()
    def _in_chunks(self, fn, obs: Batch, actions: torch.Tensor | None, n: int) -> torch.Tensor:
        """``fn`` over the whole batch in minibatch-sized pieces, no gradient -> [N]."""
        out = []
        for s in range(0, n, self.cfg.minibatch_size):
            idx = torch.arange(s, min(s + self.cfg.minibatch_size, n), device=self.device)
            args = (take(obs, idx),) if actions is None else (take(obs, idx), actions[idx])
            out.append(fn(*args))
        return torch.cat(out)

    def _reference_log_prob(self, batch: Batch, obs: Batch, actions: torch.Tensor, n: int):
        if not self.cfg.kl_active:
            return None
        if "ref_log_prob" in batch:
            return batch["ref_log_prob"].float()
        if not self._reference:
            raise ValueError(f"kl_coef > 0 needs a ReferencePolicy or 'ref_log_prob' in the "
                             f"batch; {type(self.policy).__name__} has neither")
        with self.policy.reference():
            return self._in_chunks(self._log_prob, obs, actions, n)

    def _entropy(self, sampled, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if sampled is not None:
            return entropy_bonus(sampled[1].float().reshape(-1), mask)
        return entropy_bonus(self._chunk_sum(logp), mask, score_function=True)

    def _clip(self, module) -> torch.Tensor | None:
        return parallel.clip(self.accelerator, module.parameters(), self.cfg.max_grad_norm)

    # -- the update -------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """``cfg.epochs`` epochs of shuffled minibatches over ``batch`` (layout in the module
        docstring). Returns float metrics averaged over the minibatch steps."""
        cfg = self.cfg
        batch = to_device(batch, self.device)
        actions = batch["action"]
        n = int(actions.shape[0])
        obs = {k: batch[k] for k in observation_keys(batch)}
        mask = (batch["mask"].float() if "mask" in batch
                else torch.ones(n, device=self.device))
        with torch.no_grad():
            behaviour = batch["old_log_prob"].float().reshape(-1)
            if cfg.is_truncation is not None:
                old = self._in_chunks(self._log_prob, obs, actions, n)
                is_w = truncated_is_weights(behaviour, self._chunk_sum(old), cfg.is_truncation)
            else:
                old, is_w = behaviour, None
            for key in ("is_weight", "chunk_weight"):  # importance / aggregation weights
                if key in batch:
                    given = batch[key].float()
                    is_w = given if is_w is None else is_w * given
            ref = self._reference_log_prob(batch, obs, actions, n)
            pmask = self._executed_tokens(batch, old)
            own = mask if pmask is None else batch["own_chunk"].float()  # partial chunks too
            adv = batch["advantages"].float()
            if cfg.normalize_advantages:
                adv = self._whiten(adv, own)
            pmask = None if pmask is None else own[:, None] * pmask
            returns = old_values = None
            if self.has_critic:
                returns = batch["returns"].float()
                old_values = (batch["old_values"].float() if "old_values" in batch
                              else self._in_chunks(self._value, obs, None, n))
        sums: dict[str, torch.Tensor] = {}
        steps = epochs = 0
        for _ in range(cfg.epochs):
            epochs, kl0, s0 = epochs + 1, sums.get("approx_kl", 0.0), steps
            perm = torch.randperm(n, device=self.device)
            for s in range(0, n, cfg.minibatch_size):
                idx = perm[s:s + cfg.minibatch_size]
                def pick(x, idx=idx):
                    return None if x is None else x[idx]
                m = self._minibatch_step(take(obs, idx), actions[idx], old[idx], adv[idx],
                                         mask[idx], pick(is_w), pick(ref), pick(returns),
                                         pick(old_values), pick(pmask), own[idx])
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
            if cfg.target_kl is not None and self._kl_reached(sums.get("approx_kl", 0.0) - kl0, steps - s0):
                break  # target_kl: the policy moved far enough from the rollout's this round
        out = {k: float(v) / steps for k, v in sums.items()}
        out["epochs"] = float(epochs)
        if is_w is not None:
            out["is_weight_mean"] = float(masked_mean(is_w, mask))
        if self.has_critic:
            var_r = masked_mean((returns - masked_mean(returns, own)).pow(2), own)
            resid = returns - old_values
            var_e = masked_mean((resid - masked_mean(resid, own)).pow(2), own)
            out["explained_variance"] = float(1.0 - var_e / var_r.clamp_min(1e-8))
        self.num_updates += 1
        out["num_updates"] = float(self.num_updates)
        return out

    def has_trainable_chunks(self, batch: Batch) -> bool:
        """Whether :meth:`update` can learn from ``batch``: a full policy chunk (``mask``), or
        one of the policy's own chunks cut short (``own_chunk``) where token ratios train on the
        actions that ran (``chunk.execute`` below the chunk size makes every chunk partial)."""
        if "mask" not in batch or bool(torch.as_tensor(batch["mask"]).any()):
            return True
        return self._trains_partial_chunks(batch) and bool(torch.as_tensor(batch["own_chunk"]).any())

    def _trains_partial_chunks(self, batch: Batch) -> bool:
        """Own chunks cut short train on their executed actions' tokens: token-level ratios,
        ``mask_unexecuted``, the policy's token positions and the batch's ``chunk_steps`` /
        ``own_chunk`` all present."""
        return bool(self.cfg.mask_unexecuted and self.token_level and "chunk_steps" in batch
                    and "own_chunk" in batch and callable(getattr(self.policy, "token_chunk_positions", None)))

    def _executed_tokens(self, batch: Batch, old: torch.Tensor) -> torch.Tensor | None:
        """Token-level ratios: [N, T] 1 at the tokens of the actions each chunk executed (its
        ``chunk_steps``; ``token_chunk_positions`` gives each token's place in the chunk), so that
        every own chunk (``own_chunk``: cut short by the episode's end or ``chunk.execute`` too)
        trains on what ran; None when off, per chunk, or not known (then only full chunks train)."""
        if old.ndim != 2 or not self._trains_partial_chunks(batch):
            return None
        pos = self.policy.token_chunk_positions(int(old.shape[1])).to(self.device)
        return (pos[None, :] < batch["chunk_steps"].to(self.device)[:, None]).float()

    def _kl_reached(self, kl_sum, steps: int) -> bool:
        """target_kl early stop: the last pass's mean approx_kl (the same on every rank) > it."""
        return parallel.mean_over_ranks(self.accelerator, kl_sum / max(steps, 1), self.device) > self.cfg.target_kl

    def _minibatch_step(self, obs: Batch, actions, old, adv, mask, is_w, ref, returns,
                        old_values, pmask, own) -> dict[str, torch.Tensor]:
        """One optimizer step; ``pmask`` [B, T]: the policy loss's token mask (None: ``mask``);
        ``own`` [B]: the chunks that train, the value loss's mask: with token ratios the
        policy's own chunks cut short train the value head too, not only full ones."""
        cfg = self.cfg
        sample = cfg.entropy_coef > 0 and self._sampler
        whats = (self._lp_call,) + (("sample",) if sample else ()) + (("value",) if self.has_critic else ())
        outs = dict(zip(whats, self._calls(obs, actions, what=whats)))  # one forward
        logp = outs[self._lp_call].float()
        logp = logp.reshape(logp.shape[0], -1) if self.token_level else logp.reshape(-1)
        pm = mask if pmask is None else pmask
        loss, metrics = policy_loss(logp, old, adv, cfg.clip_low, cfg.clip_high, pm, is_w,
                                    dual_clip=cfg.dual_clip)
        metrics["policy_loss"] = loss.detach()
        if ref is not None:
            kl = masked_mean(kl_penalty(cfg.kl_kind, logp, ref), per_token(pm, logp))
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.detach()
        if cfg.entropy_coef > 0:
            ent = self._entropy(outs.get("sample"), logp, mask)
            loss = loss - cfg.entropy_coef * ent
            metrics["entropy"] = ent.detach()
        if self.has_critic:
            v = outs["value"].float().reshape(-1)
            vl = value_loss(v, old_values, returns, cfg.value_clip, own)
            loss = loss + cfg.value_coef * vl
            metrics["value_loss"] = vl.detach()
            metrics["value_mean"] = masked_mean(v.detach(), own)
        self.opt.zero_grad(set_to_none=True)
        if self.value_opt is not None:
            self.value_opt.zero_grad(set_to_none=True)
        norm = parallel.backward_step(self.accelerator, self._calls, loss * parallel.rank_scale(self.accelerator, own),
                                      self.policy.parameters(), self.cfg.max_grad_norm)
        if norm is not None:
            metrics["grad_norm"] = norm
        self.opt.step()
        if self.value_opt is not None:
            self._clip(self._value_raw)
            self.value_opt.step()
        metrics["loss"] = loss.detach()
        return metrics

    # -- checkpointing ----------------------------------------------------------------------
    def parallel_engines(self) -> list:
        """The engine training policy (+ value net), for checkpoints; [] without engines."""
        return parallel.engines(self.accelerator, self._calls)

    def state_dict(self) -> dict:
        """Policy, value function (when separate), optimizers and the update counter. Under
        an engine the weights are gathered (every rank calls this together) and the optimizer
        state is the engine's own checkpoint (learner/engine_state.py), not in here."""
        state = {"policy": parallel.gathered_state(self.policy, self.accelerator),
                 "num_updates": int(self.num_updates)}
        if self._value_raw is not None:
            state["value_fn"] = parallel.gathered_state(self._value_raw, self.accelerator)
        if self.parallel_engines():
            return state
        state["opt"] = copy.deepcopy(self.opt.state_dict())
        if self.value_opt is not None:
            state["value_opt"] = copy.deepcopy(self.value_opt.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        parallel.load_gathered(self.policy, self.accelerator, state["policy"])
        self.num_updates = int(state["num_updates"])
        if self._value_raw is not None and "value_fn" in state:
            parallel.load_gathered(self._value_raw, self.accelerator, state["value_fn"])
        if "opt" not in state or self.parallel_engines():  # the engine loads its own
            return
        # torch optimizers adopt the given tensors: copy so training never mutates ``state``
        self.opt.load_state_dict(copy.deepcopy(state["opt"]))
        if self.value_opt is not None:
            self.value_opt.load_state_dict(copy.deepcopy(state["value_opt"]))

