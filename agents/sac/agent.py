"""Soft actor-critic, RLPD-style: critic ensemble (+LayerNorm), high update-to-data ratio,
min over a random subset of target critics.

``SACAgent.update(batches)`` is a pure step: it draws ``utd_ratio`` batches, runs one
critic update (and one target soft-update) per batch, then one actor and one temperature
update on the last batch, and returns float metrics. No files, sockets or logging inside.

Bootstrapping reads ``terminated`` only; ``truncated`` (time limits) still bootstraps
from the next observation, which the replay buffer keeps for truncated episodes.

Action chunks (policy ``chunk_size`` H > 1) use Q-chunking: the critic scores the whole
executed chunk Q(s_t, a_{t:t+H}), trained on replay windows of H steps (``action`` [B, H, A],
``reward`` [B, H], ``step_mask`` [B, H], ``n_steps`` [B]; see :meth:`data.replay.ReplayBuffer.sample`
with ``horizon``) against r_t + g r_{t+1} + ... + g^(k-1) r_{t+k-1} + g^k V(s_{t+k}), with k
the real steps of the window (fewer than H when the episode ended inside it).

The builder (:mod:`agents.sac.builder`) makes the networks and the data, and drives
updates; this file is the update itself. The losses are plain functions (:func:`td_target`,
:func:`critic_loss`, :func:`actor_loss`, :func:`temperature_loss`, :func:`soft_update`),
checkable on known inputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from agents import parallel
from agents.base import Batch, FeaturePolicy, ReparamSampler, check_pair
from agents.common.critics import EnsembleCritic, make_critic
from agents.common.policy_calls import to_device
from agents.parallel.sac_engines import prepare_sac_engines
from agents.sac.phases import run_phase
from data.core.spec import EnvSpec


@dataclass
class SACConfig:
    """Hyperparameters of :class:`SACAgent` and its cadence (:mod:`agents.sac.builder`);
    the variants' configs add their own keys (:class:`agents.sac.noise.NoiseSACConfig`,
    :class:`agents.sac.residual.ResidualSACConfig`).

    The defaults are ``config/algo/sac.yaml``'s, tuned for the CPU demo task
    tandem/InvertedPendulum-v0 (one thread, solved in ~1.2-2.1k env steps) with
    ``MLPPolicyConfig(hidden_dims=(64, 64))``. The usual SAC values for bigger tasks:
    tau=0.005, lrs 3e-4, batch_size=256, init_temperature=1.0, critic widths (256, 256).
    """

    #: discount factor
    gamma: float = 0.99
    #: target critic soft-update rate (target <- tau * online + (1 - tau) * target), per critic step
    tau: float = 0.05
    #: Adam learning rate of the actor
    actor_lr: float = 1e-3
    #: Adam learning rate of the critics
    critic_lr: float = 1e-3
    #: Adam learning rate of log(alpha)
    temp_lr: float = 1e-3
    #: transitions per sampled batch
    batch_size: int = 128
    #: critic updates per ``update`` call, each on its own batch
    utd_ratio: int = 2
    #: number of Q-functions in the critic ensemble
    num_critics: int = 2
    #: size of the random subset of target critics whose minimum forms the TD target
    #: (RLPD); None means all ``num_critics``
    num_min_qs: int | None = None
    #: initial temperature alpha
    init_temperature: float = 0.1
    #: entropy target of the temperature loss; None means -(chunk_size * action_dim)
    target_entropy: float | None = None
    #: hidden layer widths of each critic
    critic_hidden_dims: tuple[int, ...] = (64, 64)
    #: LayerNorm after every hidden layer of the critics (RLPD)
    critic_layer_norm: bool = True
    #: activation of the critics' hidden layers: relu, elu, gelu or silu
    critic_activation: str = "relu"
    #: what the critic reads: "own" (its own observation encoder, trained by the critic loss;
    #: needs nothing from the policy), "policy" (the policy's frozen ``features``: a small
    #: head over a VLA's backbone; needs a FeaturePolicy) or "shared" (DrQ / SERL: the critic
    #: trains the policy's ``encoder``, the actor reuses the last critic step's features
    #: detached: each observation is encoded once per network and update; the target critic
    #: keeps its own copy; needs ``encoder`` + ``sample_from_features``, e.g. MLPPolicy)
    critic_encoder: str = "own"
    #: the own encoder's per-camera CNN channels (unused without cameras)
    critic_cnn_channels: tuple[int, ...] = (32, 32, 32, 32)
    #: the own encoder's per-camera embedding size
    critic_image_embed_dim: int = 50
    #: the own encoder's state MLP width with cameras (0: raw state)
    critic_state_embed_dim: int = 64
    #: the own encoder's image encoder: "flatten" or "pool" (:mod:`agents.common.encoders`)
    critic_image_encoder: str = "flatten"
    #: subtract alpha * log pi(a'|s') inside the TD target (soft backup)
    backup_entropy: bool = True
    #: how the actor loss reduces the ensemble's Q-values: "mean" (RLPD) or "min" (SAC)
    actor_q_reduce: str = "mean"
    #: clip the global gradient norm of each network to this value (None: no clipping)
    max_grad_norm: float | None = None
    #: stored env steps before the first update
    learning_starts: int = 500
    #: at most this many updates per stored env step (0 = unlimited)
    max_update_ratio: float = 1.0
    #: updates between published weight versions
    publish_every: int = 25

    def __post_init__(self) -> None:
        if self.utd_ratio < 1:
            raise ValueError(f"utd_ratio must be >= 1, got {self.utd_ratio}")
        if self.num_critics < 1:
            raise ValueError(f"num_critics must be >= 1, got {self.num_critics}")
        if self.num_min_qs is not None and not 1 <= self.num_min_qs <= self.num_critics:
            raise ValueError(f"num_min_qs must be in [1, num_critics={self.num_critics}], "
                             f"got {self.num_min_qs}")
        if self.actor_q_reduce not in ("mean", "min"):
            raise ValueError(f"actor_q_reduce must be 'mean' or 'min', got {self.actor_q_reduce!r}")
        if self.critic_encoder not in ("own", "policy", "shared"):
            raise ValueError(f"critic_encoder must be own, policy or shared, got {self.critic_encoder!r}")
        if self.init_temperature <= 0:
            raise ValueError(f"init_temperature must be > 0, got {self.init_temperature}")
        if self.publish_every < 1 or self.learning_starts < 0 or self.max_update_ratio < 0:
            raise ValueError("publish_every must be >= 1, learning_starts and max_update_ratio >= 0")

    @property
    def requires(self) -> tuple[type, ...]:
        """The policy capabilities this configuration needs."""
        return (ReparamSampler, FeaturePolicy) if self.critic_encoder == "policy" else (ReparamSampler,)


# -- losses on known inputs -------------------------------------------------------------------
def td_target(reward: torch.Tensor, terminated: torch.Tensor, next_q: torch.Tensor,
              next_log_prob: torch.Tensor, *, alpha: torch.Tensor | float,
              gamma: float | torch.Tensor,
              backup_entropy: bool = True) -> torch.Tensor:
    """Soft TD target [B]: r + gamma * (1 - terminated) * (min_i Q_i(s', a') - alpha * logp').

    ``next_q`` [E', B] are the target critics chosen for the minimum; ``terminated`` [B]
    bool. Truncation is deliberately not an argument: a time limit still bootstraps.
    """
    v = next_q.min(dim=0).values
    if backup_entropy:
        v = v - alpha * next_log_prob
    return reward + gamma * (~terminated.bool()).to(v.dtype) * v


def critic_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over the ensemble of each member's mean squared TD error: q [E, B], target [B]."""
    return (q - target.detach().unsqueeze(0)).pow(2).mean(dim=1).sum()


def actor_loss(q: torch.Tensor, log_prob: torch.Tensor, alpha: torch.Tensor | float,
               reduce: str = "mean") -> torch.Tensor:
    """E_s[alpha * log pi(a|s) - Q(s, a)], a ~ pi reparameterised: q [E, B], log_prob [B].

    ``reduce`` combines the ensemble: "mean" (RLPD) or "min" (clipped double-Q SAC).
    """
    qr = q.mean(dim=0) if reduce == "mean" else q.min(dim=0).values
    return (alpha * log_prob - qr).mean()


def temperature_loss(log_alpha: torch.Tensor, log_prob: torch.Tensor,
                     target_entropy: float) -> torch.Tensor:
    """-alpha * (log pi + target_entropy): descending it raises alpha when the policy's
    entropy (-log pi) is below the target and lowers it when above."""
    return -(log_alpha.exp() * (log_prob.detach() + target_entropy)).mean()


@torch.no_grad()
def soft_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """target <- tau * online + (1 - tau) * target, parameter by parameter (buffers copied)."""
    tp = [p for p in target.parameters()]
    op = [p for p in online.parameters()]
    torch._foreach_lerp_(tp, op, tau)
    for tb, ob in zip(target.buffers(), online.buffers()):
        tb.copy_(ob)


class Temperature(nn.Module):
    """Holds log(alpha) as a module so that it goes through ``accelerator.prepare``."""

    def __init__(self, init_temperature: float):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(float(init_temperature)).log())

    def forward(self) -> torch.Tensor:
        return self.log_alpha.exp()


def chunk_return(reward: torch.Tensor, gamma: float, step_mask: torch.Tensor | None = None,
                 n_steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(discounted reward sum [B], bootstrap discount [B]) of a batch.

    Per-step batches (``reward`` [B]): (reward, gamma). Chunk windows (``reward`` [B, H],
    ``step_mask`` [B, H], ``n_steps`` [B]): (sum_i gamma^i r_i over the real steps,
    gamma^n_steps).
    """
    if reward.dim() == 1:
        return reward, torch.full_like(reward, gamma)
    h = reward.shape[1]
    powers = gamma ** torch.arange(h, device=reward.device, dtype=reward.dtype)
    mask = step_mask.to(reward.dtype) if step_mask is not None else torch.ones_like(reward)
    k = n_steps.to(reward.dtype) if n_steps is not None else mask.sum(1)
    return (reward * mask * powers).sum(1), torch.pow(torch.tensor(gamma, dtype=reward.dtype,
                                                                   device=reward.device), k)


def utd_update(agent, batches: Iterator[Batch], prepare) -> dict[str, float]:
    """The SAC cadence any SAC-style agent shares: ``agent.cfg.utd_ratio`` critic steps (one
    ``prepare``d batch each), then one actor + temperature step on the last batch; counts the
    update. Returns float metrics of the last critic step and the actor step."""
    metrics: dict[str, torch.Tensor] = {}
    batch: Batch | None = None
    for _ in range(agent.cfg.utd_ratio):
        batch = prepare(next(batches))
        metrics = agent.critic_step(batch)
    assert batch is not None
    metrics.update(agent.actor_step(batch))
    agent.num_updates += 1
    out = {k: float(v) for k, v in metrics.items()}
    out["num_updates"] = float(agent.num_updates)
    return out


class SACModel(nn.Module):
    """SAC's trained parts (actor, critic ensemble, temperature) behind one ``forward``, so
    that every forward that needs a gradient runs through the module ``accelerator.prepare``
    returned (DDP's all-reduce hooks; a sharded engine) and one ``prepare`` gets one model.

    Under DDP it is exact (each part keeps its optimizer; a phase's backward all-reduces the
    gradients of the parts it touched) and free on one process. Under a sharded engine SAC uses one
    engine per trained model instead (:mod:`agents.parallel.sac_engines`).

    Phases (``what``), each one forward:

    - ``"critic"``: Q(s, a) of ``actions`` [E, B] (``prefix="next."`` reads the next obs)
    - ``"next"``: (a' [B, H, A], log pi(a'|s') [B], alpha []) at ``prefix`` (no-grad target)
    - ``"critic_features"`` / ``"actor_features"`` (``critic_encoder=shared``): ``"critic"``
      also returning the features [B, D] detached / ``"actor"`` from such features
    - ``"actor"``: (a, log pi(a|s), Q(s, a) [E, B], log_alpha []) for the actor and
      temperature losses (the caller freezes the critic's parameters around it)

    The target critic is not part of it: a plain local copy on every rank, updated by the
    same soft update from the same (all-reduced) critic, so the ranks' copies stay equal;
    unsharded by choice (under ZeRO-3 it would have to be gathered every step).
    """

    def __init__(self, actor: nn.Module, critic: nn.Module, temperature: "Temperature"):
        super().__init__()
        self.actor, self.critic, self.temperature = actor, critic, temperature

    def sample(self, batch: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's reparameterised (actions, log_prob) at ``prefix``."""
        return self.actor.sample(batch, prefix)

    def forward(self, batch: Batch, what: str, actions: torch.Tensor | None = None,
                prefix: str = ""):
        if what == "critic_features":
            feats = self.critic.encoder(batch, prefix)
            return self.critic.q(feats, actions), feats.detach()
        if what == "actor_features":  # ``batch`` is the detached features here
            a, logp = self.actor.sample_from_features(batch)
            return a, logp, self.critic.q(batch, a), self.temperature.log_alpha.view(())
        return run_phase(what, batch, actions, prefix, sample=self.sample, critic=self.critic,
                         temperature=self.temperature, score=self.critic, unknown="unknown SAC phase {!r}")


class LocalSteps:
    """SAC's optimizer steps and checkpoint state on one process or under DDP (one prepared
    model, three optimizers); :class:`agents.parallel.sac_engines.EngineSteps` is the same over
    the two sharded engines. :func:`prepare_sac` sets one as ``agent.steps``."""

    def __init__(self, agent):
        self.agent = agent

    def critic(self, loss: torch.Tensor) -> None:
        """The critic's backward and step, then the target's soft update."""
        a = self.agent
        a.critic_opt.zero_grad(set_to_none=True)
        a.accelerator.backward(loss)
        a._clip(a._critic_raw)
        a.critic_opt.step()
        soft_update(a.target_critic, a._critic_raw, a.cfg.tau)

    def actor(self, loss: torch.Tensor) -> None:
        """The backward of actor + temperature loss and the actor's step (the caller steps
        ``temp_opt``)."""
        a = self.agent
        a.actor_opt.zero_grad(set_to_none=True)
        a.accelerator.backward(loss)
        a._clip(a._actor_raw)
        a.actor_opt.step()

    def state_dict(self) -> dict:
        """Policy, critics, target critics, log_alpha, the three optimizers and the counter."""
        a = self.agent
        return {
            "policy": {k: v.detach().clone() for k, v in a._actor_raw.state_dict().items()},
            "critic": {k: v.detach().clone() for k, v in a._critic_raw.state_dict().items()},
            "target_critic": {k: v.detach().clone() for k, v in a.target_critic.state_dict().items()},
            "log_alpha": a._temp_raw.log_alpha.detach().clone(),
            "actor_opt": copy.deepcopy(a.actor_opt.state_dict()),
            "critic_opt": copy.deepcopy(a.critic_opt.state_dict()),
            "temp_opt": copy.deepcopy(a.temp_opt.state_dict()),
            "num_updates": int(a.num_updates),
        }

    def load_state_dict(self, state: dict) -> None:
        a = self.agent
        a._actor_raw.load_state_dict(state["policy"])
        a._critic_raw.load_state_dict(state["critic"])
        a.target_critic.load_state_dict(state["target_critic"])
        with torch.no_grad():
            a._temp_raw.log_alpha.copy_(state["log_alpha"])
        # torch optimizers adopt the given tensors (no copy): copy so that training this agent
        # never mutates the caller's state dict
        for name in ("actor_opt", "critic_opt", "temp_opt"):  # a sharded run's engines hold
            if name in state:  # its actor/critic optimizers: evaluating it reads the weights only
                getattr(a, name).load_state_dict(copy.deepcopy(state[name]))
        a.num_updates = int(state["num_updates"])


def prepare_sac(agent, model: SACModel, actor_params, critic: nn.Module, temperature: nn.Module,
                engines: bool = False):
    """Optimizers for the three parts, ``model`` through ``accelerator.prepare`` (one model,
    three optimizers: DDP or one process; sharded, with ``engines``, two engines:
    :mod:`agents.parallel.sac_engines`). Sets ``agent.model`` (prepared), ``agent.actor_opt``/
    ``critic_opt``/``temp_opt``, ``agent.engines`` (None when not sharded), ``agent.steps``
    (:class:`LocalSteps` or :class:`agents.parallel.sac_engines.EngineSteps`), the raw parts
    ``agent._actor_raw``/``_critic_raw``/``_temp_raw`` and the target critic."""
    acc, cfg = agent.accelerator, agent.cfg
    agent.engines = None
    if parallel.uses_engines(acc):
        if not engines:
            parallel.refuse_engines(acc, f"{type(agent).__name__} does not run on sharded engines (ZeRO)")
        return prepare_sac_engines(agent, model.actor, actor_params, critic, temperature, run_phase)
    # fused Adam: one kernel per step instead of ~10 ops per tensor (2x faster on CPU)
    fused = acc.device.type in ("cpu", "cuda")
    model.to(acc.device)
    actor_opt = torch.optim.Adam(actor_params, lr=cfg.actor_lr, fused=fused)
    critic_opt = torch.optim.Adam([p for p in critic.parameters() if p.requires_grad],
                                  lr=cfg.critic_lr, fused=fused)
    temp_opt = torch.optim.Adam(temperature.parameters(), lr=cfg.temp_lr, fused=fused)
    agent.model, agent.actor_opt, agent.critic_opt, agent.temp_opt = acc.prepare(
        model, actor_opt, critic_opt, temp_opt)
    # the raw parts, taken once (accelerator.unwrap_model is slow: package metadata look-ups)
    raw: SACModel = acc.unwrap_model(agent.model)
    agent._actor_raw, agent._critic_raw, agent._temp_raw = raw.actor, raw.critic, raw.temperature
    # the raw parts under their plain names, for evaluation calls (no gradient sync through them)
    agent.critic, agent.temperature = raw.critic, raw.temperature
    agent.target_critic = copy.deepcopy(raw.critic).to(acc.device)
    agent.target_critic.requires_grad_(False)
    agent.steps = LocalSteps(agent)


def sac_critic_step(agent, batch: Batch, actions: torch.Tensor) -> dict[str, torch.Tensor]:
    """One critic update of ``Q(batch, actions)`` and one target soft-update (SAC and
    noise-space SAC); every forward through ``agent.model``."""
    with torch.no_grad():
        next_a, next_logp, alpha = agent.model(batch, "next", prefix="next.")
        next_q = agent._target_q_subset(agent.target_critic(batch, next_a, "next."))
        reward, discount = chunk_return(batch["reward"].float(), agent.cfg.gamma,
                                        batch.get("step_mask"), batch.get("n_steps"))
        target = td_target(reward, batch["terminated"], next_q, next_logp, alpha=alpha,
                           gamma=discount, backup_entropy=agent.cfg.backup_entropy)
    if getattr(agent, "shared_encoder", False):
        q, feats = agent.model(batch, "critic_features", actions)
        agent._features = (batch, feats)  # the actor step on this batch reuses them
    else:
        q = agent.model(batch, "critic", actions)
    loss = critic_loss(q, target)
    agent.steps.critic(loss)
    return {"critic_loss": loss.detach(), "q_mean": q.detach().mean(), "target_q_mean": target.mean()}


def sac_actor_step(agent, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One actor and one temperature update on ``batch`` from one forward and one backward of
    the sum of both losses (their gradients are disjoint: the actor loss sees alpha detached,
    the temperature loss log pi detached), so each reaches its optimizer as after two
    separate backwards. Returns (detached metrics, the actions)."""
    critic = agent._critic_raw
    critic.requires_grad_(False)
    try:
        if getattr(agent, "shared_encoder", False):
            hit = agent._features is not None and agent._features[0] is batch
            feats = agent._features[1] if hit else critic.encoder(batch).detach()
            agent._features = None
            a, logp, q, log_alpha = agent.model(feats, "actor_features")
        else:
            a, logp, q, log_alpha = agent.model(batch, "actor")
        alpha = log_alpha.exp().detach()
        a_loss = actor_loss(q, logp, alpha, agent.cfg.actor_q_reduce)
        t_loss = temperature_loss(log_alpha, logp.detach(), agent.target_entropy)
        agent.temp_opt.zero_grad(set_to_none=True)
        agent.steps.actor(a_loss + t_loss)
        agent.temp_opt.step()
    finally:
        critic.requires_grad_(True)
    return ({"actor_loss": a_loss.detach(), "temperature_loss": t_loss.detach(),
             "entropy": -logp.detach().mean(), "alpha": alpha}, a)


class SACAgent:
    """SAC over a :class:`agents.base.ReparamSampler` policy (``sample(obs, prefix)`` ->
    (actions [B, H, A], log_prob [B]), reparameterised; ``prefix="next."`` reads the next
    observation).

    The policy, critic and temperature go through ``accelerator.prepare`` as one
    :class:`SACModel` (why: its docstring); every forward runs through the prepared model,
    so under DDP each rank's gradients are all-reduced (mean) before the optimizer steps.
    ``self.policy`` stays the unwrapped policy (what weight broadcasts read). ``critic`` may
    be passed in (the builder makes it, :func:`make_critic`); otherwise it is made here.
    """

    name = "sac"

    def __init__(self, cfg: SACConfig, policy, spec: EnvSpec, accelerator: Any,
                 critic: EnsembleCritic | None = None):
        check_pair(self.name, cfg.requires, type(policy).__name__, policy)
        self.cfg = cfg
        self.spec = spec
        self.accelerator = accelerator
        self.policy = policy
        chunk = int(getattr(policy, "chunk_size", 1))
        self.target_entropy = (float(cfg.target_entropy) if cfg.target_entropy is not None
                               else -float(chunk * spec.action_dim))
        self.num_min_qs = cfg.num_min_qs or cfg.num_critics
        critic = critic if critic is not None else make_critic(cfg, spec, policy)
        temperature = Temperature(cfg.init_temperature)
        #: the critic trains the policy's encoder; the actor reads its features detached
        self.shared_encoder = cfg.critic_encoder == "shared"
        self._features = None
        critic_params = {id(p) for p in critic.parameters()} if self.shared_encoder else set()
        prepare_sac(self, SACModel(policy, critic, temperature),
                    [p for p in policy.parameters() if p.requires_grad and id(p) not in critic_params],
                    critic, temperature, engines=True)
        self.device = accelerator.device
        self.num_updates = 0

    # -- helpers ----------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        return float(self._temp_raw.log_alpha.detach().exp())

    def _clip(self, module: nn.Module) -> None:
        if self.cfg.max_grad_norm is not None:
            self.accelerator.clip_grad_norm_(module.parameters(), self.cfg.max_grad_norm)

    def _target_q_subset(self, next_q: torch.Tensor) -> torch.Tensor:
        """A random ``num_min_qs`` of the ensemble's target Qs [E, B] (REDQ's subset min)."""
        if self.num_min_qs >= next_q.shape[0]:
            return next_q
        idx = torch.randperm(next_q.shape[0], device=next_q.device)[: self.num_min_qs]
        return next_q.index_select(0, idx)

    # -- the update -------------------------------------------------------------------------
    def critic_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One critic update and one target soft-update on ``batch``; returns detached metrics."""
        return sac_critic_step(self, batch, batch["action"])

    def actor_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One actor and one temperature update on ``batch``; returns detached metrics."""
        return sac_actor_step(self, batch)[0]

    def update(self, batches: Iterator[Batch]) -> dict[str, float]:
        """``utd_ratio`` critic steps (one batch each), then one actor + temperature step on
        the last batch. Returns float metrics of the last critic step and the actor step."""
        return utd_update(self, batches, lambda b: to_device(b, self.device))

    # -- checkpointing ----------------------------------------------------------------------
    def parallel_engines(self) -> list:
        return list(self.engines or ())

    def state_dict(self) -> dict:
        """Policy, critics, target critics, log_alpha, the optimizers and the counter
        (:class:`LocalSteps`; sharded: :class:`agents.parallel.sac_engines.EngineSteps`)."""
        return self.steps.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.steps.load_state_dict(state)
