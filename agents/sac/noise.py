"""Noise-space SAC (DSRL, Wagenmaker et al. 2025): SAC whose action is the initial noise of a
frozen flow policy's denoising ODE (``algo=sac_noise policy=pi0``).

The policy is a :class:`agents.sac.noise_actor.NoiseSpacePolicy`: the frozen PI0 plus a small
tanh-Gaussian noise actor. One transition is one executed chunk: a replay window of H steps
that starts at a chunk start (``chunk_start``), with ``extra.noise`` [B, H, D] the noise PI0
started from (the stored SAC action; the critic reads the actor's d dims of it), ``action``
[B, H, A] the executed chunk, ``reward`` [B, H], ``step_mask`` / ``n_steps`` and the
observation after the chunk (``next.``). The TD target is the chunk's discounted reward
plus gamma^k (min Q_target(s', w') - alpha log pi(w'|s')), w' ~ pi(.|s') in noise space.

Features are computed once per batch (:func:`attach_features`: obs and next obs in one
frozen forward) and stored in the batch as ``features`` / ``next.features``; the critic
(:class:`CachedFeatures` encoder) and the actor both read them: the VLA backbone never runs
twice for one batch, and no gradient reaches it. With ``noise_feature_cache`` > 0 (:class:`FeatureCache`) the
backbone runs once per distinct observation instead (replay rows recur across critic steps),
which is what makes a high UTD affordable on a CPU.

``NoiseSACAgent.update(batches)`` is a pure step (no files, sockets or logging):
``utd_ratio`` critic steps, then one actor and one temperature step on the last batch. The
losses are :mod:`agents.sac.agent`'s (:func:`agents.sac.agent.td_target`, ``critic_loss``, ``actor_loss``,
``temperature_loss``, ``soft_update``, ``chunk_return``).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from agents.base import Batch, NoiseConditionedPolicy
from agents.common.critics import EnsembleCritic
from agents.sac.noise_actor import NOISE_EXTRA, NoiseSpacePolicy
from agents.common.policy_calls import to_device
from agents.sac.agent import (SACAgent, SACConfig, SACModel, Temperature, prepare_sac,
                        sac_actor_step, sac_critic_step, utd_update)
from data.core.spec import EnvSpec

FEATURES = "features"


@dataclass
class FrozenBaseSACConfig(SACConfig):
    """:class:`agents.sac.agent.SACConfig` of SAC over a small actor on a frozen base policy's
    features, one transition per executed chunk (noise-space and residual SAC)."""

    #: env steps each chunk runs (the actor's ``chunk.execute``; 0: the whole chunk)
    execute_steps: int = 0
    #: frozen features kept per distinct observation (0: recompute every batch)
    noise_feature_cache: int = 200_000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.execute_steps < 0:
            raise ValueError(f"execute_steps must be >= 0, got {self.execute_steps}")


@dataclass
class NoiseSACConfig(FrozenBaseSACConfig):
    """``algo=sac_noise``: a small actor outputs the initial noise of a frozen flow policy
    (PI0/PI0.5, a NoiseConditionedPolicy), the critic scores (features, noise)."""

    #: the actor's noise is ``noise_scale * tanh(u)`` (DSRL's action magnitude)
    noise_scale: float = 1.5
    #: "action" (the actor sets the first action_dim noise dims of each step, zeros in the
    #: flow's padded dims) or "all" (every dim of the flow's noise)
    noise_dims: str = "action"
    #: hidden widths of the noise actor (LayerNorm + ``critic_activation``)
    noise_actor_hidden_dims: tuple[int, ...] = (256, 256)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.noise_dims not in ("action", "all") or self.noise_scale <= 0:
            raise ValueError("noise_dims must be 'action' or 'all', noise_scale > 0")

    @property
    def requires(self) -> tuple[type, ...]:
        return (NoiseConditionedPolicy,)


class CachedFeatures(nn.Module):
    """A critic encoder that reads the features :func:`attach_features` put in the batch
    (``features`` / ``next.features`` [B, F]): no parameters, no model call."""

    def __init__(self, dim: int):
        super().__init__()
        self.out_dim = int(dim)

    def forward(self, obs: Batch, prefix: str = "") -> torch.Tensor:
        key = prefix + FEATURES
        if key not in obs:
            raise KeyError(f"batch has no {key!r}: call attach_features(policy, batch) first")
        return obs[key]


class FeatureCache:
    """Frozen features by observation content, so the backbone runs once per distinct
    observation, not once per critic step (a replay row is drawn ~``utd_ratio * batch /
    buffer`` times). Key: a 16-byte BLAKE2 digest of the row's ``observation.*`` bytes and
    its task; at most ``max_rows`` entries (first in, first out). Exact: the base is frozen."""

    def __init__(self, max_rows: int = 200_000):
        self.max_rows = int(max_rows)
        self._rows: dict[bytes, torch.Tensor] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def keys(obs: Batch) -> list[bytes]:
        names = sorted(k for k in obs if k.startswith("observation."))
        arrays = [obs[k].detach().cpu().contiguous().numpy() for k in names]
        tasks = obs.get("task")
        out = []
        for i in range(arrays[0].shape[0]):
            h = hashlib.blake2b(digest_size=16)
            for a in arrays:
                h.update(a[i].tobytes())
            if tasks is not None:
                h.update(str(tasks[i]).encode())
            out.append(h.digest())
        return out

    def features(self, policy: NoiseSpacePolicy, obs: Batch) -> torch.Tensor:
        """[B, F] float32: cached rows looked up, the others computed in one frozen pass."""
        keys = self.keys(obs)
        rows = [self._rows.get(k) for k in keys]
        missing = [i for i, r in enumerate(rows) if r is None]
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        if missing:
            idx = torch.tensor(missing)
            sub = {k: v.index_select(0, idx.to(v.device)) for k, v in obs.items() if k.startswith("observation.")}
            if "task" in obs:
                sub["task"] = [obs["task"][i] for i in missing]
            f = policy.features(sub).float()
            for j, i in enumerate(missing):
                rows[i] = self._rows[keys[i]] = f[j]
            while len(self._rows) > self.max_rows:
                self._rows.pop(next(iter(self._rows)))
        return torch.stack(rows)


@torch.no_grad()
def attach_features(policy: NoiseSpacePolicy, batch: Batch, cache: FeatureCache | None = None) -> Batch:
    """``batch`` with ``features`` and ``next.features`` [B, F] (float32, no grad), from one
    frozen forward over the observations and the next observations together (with a
    ``cache``: over those of them it has not seen)."""
    if FEATURES in batch and "next." + FEATURES in batch:
        return batch
    n = batch["observation.state"].shape[0]
    both: Batch = {}
    for k, v in batch.items():
        if k.startswith("observation."):
            both[k] = torch.cat([v, batch["next." + k]])
    if "task" in batch:
        both["task"] = list(batch["task"]) * 2
    f = policy.features(both).float() if cache is None else cache.features(policy, both)
    return {**batch, FEATURES: f[:n], "next." + FEATURES: f[n:]}


def make_noise_critic(cfg: SACConfig, policy: NoiseSpacePolicy) -> EnsembleCritic:
    """Q(features, noise) ensemble over the actor's H * d noise values."""
    return EnsembleCritic(CachedFeatures(policy.feature_dim), policy.noise_actor.flat_dim,
                          num_critics=cfg.num_critics, hidden_dims=tuple(cfg.critic_hidden_dims),
                          layer_norm=cfg.critic_layer_norm, activation_name=cfg.critic_activation)


class NoiseSACModel(SACModel):
    """:class:`agents.sac.agent.SACModel` whose actor is the noise actor, reading the batch's frozen
    ``features`` (``prefix + "features"``) instead of the observation."""

    def sample(self, batch: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor.sample(batch[prefix + FEATURES])


class NoiseSACAgent:
    """SAC over the noise actor of a :class:`NoiseSpacePolicy` (module docstring). The noise
    actor, critic and temperature go through ``accelerator.prepare`` as one
    :class:`NoiseSACModel` (every forward through it, so DDP all-reduces the gradients); the
    frozen base does not (it has no trainable parameter and no optimizer)."""

    name = "sac"
    #: what it trains (a subclass reuses the update: :mod:`agents.sac.residual`): the served
    #: policy's type, the attribute of its SAC actor, the tag its checkpoints carry
    policy_type: type = NoiseSpacePolicy
    actor_attr = "noise_actor"
    action_space = "noise"

    def __init__(self, cfg: FrozenBaseSACConfig, policy: NoiseSpacePolicy, spec: EnvSpec, accelerator: Any,
                 critic: EnsembleCritic | None = None):
        if not isinstance(policy, self.policy_type):
            raise TypeError(f"{self.action_space}-space SAC trains a {self.policy_type.__name__}, "
                            f"got {type(policy).__name__}")
        self.cfg, self.spec, self.accelerator = cfg, spec, accelerator
        self.policy = policy
        actor = getattr(policy, self.actor_attr)
        self.target_entropy = (float(cfg.target_entropy) if cfg.target_entropy is not None
                               else -float(actor.flat_dim))
        self.num_min_qs = cfg.num_min_qs or cfg.num_critics
        critic = critic if critic is not None else make_noise_critic(cfg, policy)
        temperature = Temperature(cfg.init_temperature)
        self.device = accelerator.device
        policy.to(self.device)  # the frozen base too (not part of the prepared model)
        prepare_sac(self, NoiseSACModel(actor, critic, temperature), list(actor.parameters()),
                    critic, temperature)
        self.num_updates = 0
        self.feature_cache = FeatureCache(cfg.noise_feature_cache) if cfg.noise_feature_cache > 0 else None

    # the same gradient clip and target-Q subset as SAC's
    _clip = SACAgent._clip
    _target_q_subset = SACAgent._target_q_subset

    def stored_noise(self, batch: Batch) -> torch.Tensor:
        """The SAC action of each row: the actor's dims [B, H, d] of ``extra.noise``."""
        return self.policy.actor_noise(batch["extra." + NOISE_EXTRA].float())

    def critic_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One critic update (and target soft-update) on a batch with features attached."""
        return sac_critic_step(self, batch, self.stored_noise(batch))

    def actor_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One actor step (through the frozen critic) and one temperature step."""
        metrics, w = sac_actor_step(self, batch)
        metrics["noise_abs_mean"] = w.detach().abs().mean()
        return metrics

    def update(self, batches: Iterator[Batch]) -> dict[str, float]:
        return utd_update(self, batches, lambda b: attach_features(
            self.policy, to_device(b, self.device), self.feature_cache))

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Noise actor, critics, target critics, log_alpha, the optimizers and the counter
        (the frozen base is rebuilt from its checkpoint)."""
        clone = lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()}  # noqa: E731
        return {"policy": self.policy.trainable_state_dict(), "critic": clone(self._critic_raw),
                "target_critic": clone(self.target_critic),
                "log_alpha": self._temp_raw.log_alpha.detach().clone(),
                "actor_opt": copy.deepcopy(self.actor_opt.state_dict()),
                "critic_opt": copy.deepcopy(self.critic_opt.state_dict()),
                "temp_opt": copy.deepcopy(self.temp_opt.state_dict()),
                "num_updates": int(self.num_updates), "action_space": self.action_space}

    def load_state_dict(self, state: dict) -> None:
        if state.get("action_space") != self.action_space:
            raise ValueError(f"checkpoint is not of {self.action_space}-space SAC "
                             f"(algo=sac_{self.action_space})")
        self.policy.load_trainable_state_dict(state["policy"])
        self._critic_raw.load_state_dict(state["critic"])
        self.target_critic.load_state_dict(state["target_critic"])
        with torch.no_grad():
            self._temp_raw.log_alpha.copy_(state["log_alpha"])
        self.actor_opt.load_state_dict(copy.deepcopy(state["actor_opt"]))
        self.critic_opt.load_state_dict(copy.deepcopy(state["critic_opt"]))
        self.temp_opt.load_state_dict(copy.deepcopy(state["temp_opt"]))
        self.num_updates = int(state["num_updates"])
