"""The update cadence of on-policy algorithms (PPO, GRPO): rounds of whole episodes.

:class:`OnPolicyLearner` (the :class:`agents.core.AlgoLearner` of PPO and GRPO) asks its
*collector* for a round each :meth:`~OnPolicyLearner.step`. A collector waits until the
rollout queue (:class:`data.rollouts.RolloutQueue`) holds a round's worth of episodes,
takes them, cuts them into action chunks (:func:`chunk_batch`), computes advantages and
hands back the flat per-chunk batch of :mod:`agents.ppo.agent`. The learner runs the agent's
``update(batch)`` on it and, every ``publish_every`` rounds, asks for a new weights version
(so the round's rollouts were all made by at most ``max_staleness`` versions ago).

- :class:`EpisodeRounds` (PPO): ``batch_episodes`` fresh episodes from actors running as they
  like; advantages by GAE over chunks with a value function (``estimator="gae"``) or by
  REINFORCE++ (``"reinforce_pp"``, no critic).
- GRPO's group rounds and its job source are in :mod:`agents.grpo.builder`.

Staleness: the queue drops episodes more than ``max_staleness`` versions old; the records'
behaviour log-probs go into the batch as ``old_log_prob`` and the agent reweights stale
chunks by the truncated ratio pi_current / pi_behaviour (:func:`agents.ppo.agent.truncated_is_weights`).

Discounting over chunks: ``gamma`` is per chunk (:class:`agents.ppo.agent.PPOConfig`); a chunk's
reward is the plain sum of its steps' rewards, and a chunk of n != H steps (a human's
stretch) is discounted by ``gamma ** (n / H)``. GAE (:func:`agents.common.advantages.gae`) takes one
scalar gamma, so that per-chunk discount is folded into the bootstrap value:
``next_value * discount / gamma`` makes every TD error exact; only the lambda-trace of an
irregular chunk uses ``gamma`` instead of its own discount.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from agents.common.advantages import gae, reinforce_pp
from agents.core import direct_route
from data.core.schema import EXTRA_PREFIX, TASK
from data.rollouts import LOG_PROB, RolloutEpisode, RolloutQueue, episode_chunks

OBS_PREFIX = "observation."


@dataclass
class ChunkBatch:
    """The chunks of B episodes, flat (N chunks) with their place in a padded [B, T] layout.

    ``obs``: observation keys [N, ...], ``task`` (list of N) and the chunk-start records'
    policy extras ``extra.<name>`` [N, ...] but ``log_prob``; ``final_obs``: each episode's
    final observation (its ``is_last`` record), [B, ...]. Everything else is [N] unless said.
    """

    obs: dict[str, Any]
    final_obs: dict[str, Any]
    action: torch.Tensor            # float32 [N, H, A]
    reward: torch.Tensor            # float32
    discount: torch.Tensor          # float32: gamma ** (steps / H)
    terminated: torch.Tensor        # bool
    truncated: torch.Tensor         # bool
    behaviour_log_prob: torch.Tensor  # float32: the chunk-start record's extra.log_prob
    policy_version: torch.Tensor    # int64
    policy_mask: torch.Tensor       # bool: may enter the policy loss (data.rollouts)
    row: torch.Tensor               # int64: the chunk's episode b
    col: torch.Tensor               # int64: its position t in the episode
    lengths: list[int] = field(default_factory=list)  # chunks per episode [B]
    steps: torch.Tensor | None = None  # int64 [N]: env steps each chunk executed (1..H)
    own_mask: torch.Tensor | None = None  # bool [N]: the policy's own chunk, any length (data.rollouts)

    def __len__(self) -> int:
        return int(self.row.shape[0])

    @property
    def num_episodes(self) -> int:
        return len(self.lengths)

    def padded(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Flat [N] -> padded [B, T]."""
        out = x.new_full((self.num_episodes, max(self.lengths, default=0)), fill)
        out[self.row, self.col] = x
        return out

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """Padded [B, T] -> flat [N]."""
        return x[self.row, self.col]

    def mask(self) -> torch.Tensor:
        """[B, T] True at real chunks."""
        return self.padded(torch.ones(len(self), dtype=torch.bool), False)

    def next_values(self, values: torch.Tensor, final_values: torch.Tensor) -> torch.Tensor:
        """V of each chunk's next observation [N]: the next chunk's start, or the episode's
        final observation for its last chunk."""
        nxt = torch.empty_like(values)
        last = self.col == torch.as_tensor(self.lengths, dtype=torch.long)[self.row] - 1
        inner = torch.nonzero(~last).squeeze(-1)
        nxt[inner] = values[inner + 1]  # chunks are stored episode by episode, in order
        nxt[last] = final_values[self.row[last]].to(values.dtype)
        return nxt


def chunk_batch(episodes: list[RolloutEpisode], *, horizon: int, gamma: float) -> ChunkBatch:
    """Episodes -> their chunks (:func:`data.rollouts.episode_chunks`), as torch tensors on
    the CPU. Observations are those of each chunk's first step (the one the policy saw)."""
    if not episodes:
        raise ValueError("chunk_batch needs at least one episode")
    obs_keys = sorted(k for k in episodes[0].arrays if k.startswith(OBS_PREFIX))
    # the chunk-start record's policy extras ride along: a policy's log_prob may need them
    # (PI0's denoising chain); the behaviour log-prob has its own field
    extra_keys = sorted(k for k in episodes[0].arrays if k.startswith(EXTRA_PREFIX) and k != LOG_PROB)
    parts = [episode_chunks(ep, horizon, gamma) for ep in episodes]
    obs: dict[str, Any] = {k: [] for k in obs_keys + extra_keys}
    final: dict[str, Any] = {k: [] for k in obs_keys}
    tasks, final_tasks = [], []
    for ep, ch in zip(episodes, parts):
        last = int(np.flatnonzero(ep.arrays["is_last"])[-1])
        for k in obs_keys:
            obs[k].append(ep.arrays[k][ch.obs_index])
            final[k].append(ep.arrays[k][last:last + 1])
        for k in extra_keys:
            obs[k].append(ep.arrays[k][ch.obs_index])
        tasks += [ep.tasks[i] for i in ch.obs_index.tolist()]
        final_tasks.append(ep.tasks[last])

    def cat(name: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([getattr(p, name) for p in parts]))

    obs_t = {k: torch.from_numpy(np.concatenate(v)) for k, v in obs.items()}
    final_t = {k: torch.from_numpy(np.concatenate(v)) for k, v in final.items()}
    if any(tasks) or any(final_tasks):
        obs_t[TASK], final_t[TASK] = tasks, final_tasks
    lengths = [len(p) for p in parts]
    row = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)])
    col = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    return ChunkBatch(obs_t, final_t, cat("action"), cat("reward"), cat("discount"),
                      cat("terminated"), cat("truncated"), cat("behaviour_log_prob"),
                      cat("policy_version"), cat("policy_mask"), row, col, lengths,
                      steps=cat("steps"), own_mask=cat("own_mask"))


def _take(obs: dict, s: int, e: int, device) -> dict:
    return {k: (v[s:e].to(device) if isinstance(v, torch.Tensor) else v[s:e]) for k, v in obs.items()}


@torch.no_grad()
def batched_values(value_fn: Callable, obs: dict, n: int, device, size: int = 256) -> torch.Tensor:
    """``value_fn(obs) -> [B]`` over ``n`` rows in pieces of ``size``, no gradient -> [n] (CPU)."""
    out = [value_fn(_take(obs, s, min(s + size, n), device)).float().reshape(-1).cpu()
           for s in range(0, n, size)]
    return torch.cat(out) if out else torch.zeros(0)


def gae_advantages(cb: ChunkBatch, values: torch.Tensor, final_values: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each episode's chunks -> (advantages [N], returns [N]); see the module
    docstring for the per-chunk discount."""
    nv = cb.next_values(values, final_values) * cb.discount / gamma
    adv, ret = gae(cb.padded(cb.reward), cb.padded(values), cb.padded(nv),
                   cb.padded(cb.terminated, False), cb.padded(cb.truncated, False), cb.mask(),
                   gamma, lam)
    return cb.flat(adv), cb.flat(ret)


def episode_mean_weights(cb: ChunkBatch) -> torch.Tensor:
    """[N] chunk weights that give every episode the same total weight in a chunk mean
    (N / (B * its length)): verl's seq-mean-token-mean. Without them a failed episode that
    ran to the time limit outweighs a quick success by its length."""
    lengths = torch.as_tensor(cb.lengths, dtype=torch.float32)[cb.row]
    return len(cb) / (cb.num_episodes * lengths)


def ppo_batch(cb: ChunkBatch, advantages: torch.Tensor, *, returns: torch.Tensor | None = None,
              old_values: torch.Tensor | None = None, episode_mean: bool = False) -> dict[str, Any]:
    """The flat per-chunk batch of :meth:`agents.ppo.agent.PPOAgent.update` (``episode_mean``: with
    ``chunk_weight``, :func:`episode_mean_weights`)."""
    batch: dict[str, Any] = dict(cb.obs)
    batch.update(action=cb.action, old_log_prob=cb.behaviour_log_prob,
                 advantages=advantages.float(), mask=cb.policy_mask)
    if cb.steps is not None and cb.own_mask is not None:  # token ratios: the executed actions of
        batch.update(chunk_steps=cb.steps, own_chunk=cb.own_mask)  # any own chunk (PPOAgent.update)
    if episode_mean:
        batch["chunk_weight"] = episode_mean_weights(cb).to(advantages.device)
    if returns is not None:
        batch["returns"] = returns.float()
    if old_values is not None:
        batch["old_values"] = old_values.float()
    return batch


def episode_metrics(episodes: list[RolloutEpisode], cb: ChunkBatch | None = None, *,
                    current_version: int | None = None) -> dict[str, float]:
    """Round figures; with ``current_version``, the policy-version lag of the round's
    rollouts (versions between the oldest that acted in an episode and the learner's)."""
    out = {"round_episodes": float(len(episodes)),
           "round_success": float(np.mean([e.success for e in episodes])) if episodes else 0.0,
           "round_return": float(np.mean([e.ret for e in episodes])) if episodes else 0.0,
           "round_length": float(np.mean([e.length for e in episodes])) if episodes else 0.0}
    if current_version is not None and episodes:
        lags = [int(current_version) - e.min_version for e in episodes]
        out["round_version_lag_mean"] = float(np.mean(lags))
        out["round_version_lag_max"] = float(max(lags))
    if cb is not None:
        out["round_chunks"] = float(len(cb))
        out["round_policy_chunks"] = float(cb.policy_mask.sum())
    return out


@dataclass
class Round:
    """What a collector hands the learner: the agent's batch (None: nothing to learn from,
    e.g. every group dropped by dynamic sampling), metrics and what to do after the update."""

    batch: dict[str, Any] | None
    metrics: dict[str, float]
    #: called at the learner's next step, after the update and its publication (GRPO: close
    #: the round, so that the next one is issued to the new weights)
    done: Callable[[], None] | None = None


class EpisodeRounds:
    """PPO's collector: ``batch_episodes`` fresh episodes per round, from free-running actors."""

    def __init__(self, queue: RolloutQueue, *, batch_episodes: int, horizon: int, gamma: float,
                 lam: float, estimator: str = "gae", value_fn: Callable | None = None,
                 device: torch.device | str = "cpu", min_chunks: int = 0, episode_mean: bool = False):
        if estimator not in ("gae", "reinforce_pp"):
            raise ValueError(f"PPO without job groups supports estimator gae or reinforce_pp, "
                             f"got {estimator!r} (group estimators need algo=grpo)")
        if estimator == "gae" and value_fn is None:
            raise ValueError("estimator 'gae' needs a value function")
        self.queue = queue
        self.batch_episodes = int(batch_episodes)
        self.min_chunks = int(min_chunks)
        self.horizon, self.gamma, self.lam = int(horizon), float(gamma), float(lam)
        self.estimator = estimator
        self.episode_mean = bool(episode_mean)
        self.value_fn = value_fn
        self.device = torch.device(device)
        self._carry: list[RolloutEpisode] = []

    def _ready(self, current_version: int) -> bool:
        need = self.batch_episodes - len(self._carry)
        if need > 0:
            if len(self.queue) < need:
                return False
            self._carry += self.queue.take(need, current_version=current_version)
            if len(self._carry) < self.batch_episodes:
                return False
        if self.min_chunks and sum(e.length for e in self._carry) < self.min_chunks * self.horizon:
            if len(self.queue) == 0:
                return False
            self._carry += self.queue.take(len(self.queue), current_version=current_version)
            return sum(e.length for e in self._carry) >= self.min_chunks * self.horizon
        return True

    def collect(self, current_version: int) -> Round | None:
        if not self._ready(current_version):
            return None
        episodes, self._carry = self._carry, []
        cb = chunk_batch(episodes, horizon=self.horizon, gamma=self.gamma)
        m = episode_metrics(episodes, cb, current_version=current_version)
        if self.estimator == "gae":
            values = batched_values(self.value_fn, cb.obs, len(cb), self.device)
            finals = batched_values(self.value_fn, cb.final_obs, cb.num_episodes, self.device)
            adv, ret = gae_advantages(cb, values, finals, self.gamma, self.lam)
            m["value_rollout_mean"] = float(values.mean())
            return Round(ppo_batch(cb, adv, returns=ret, old_values=values, episode_mean=self.episode_mean), m)
        adv, ret = reinforce_pp(cb.padded(cb.reward), cb.mask(), self.gamma)
        return Round(ppo_batch(cb, cb.flat(adv), episode_mean=self.episode_mean), m)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class OnPolicyLearner:
    """Rounds of collect -> ``agent.update(batch)`` -> publish (see the module docstring).

    ``version`` is the weights version this learner's policy has been published as (0 at the
    start; the learner app publishes a new one whenever :meth:`should_publish` says so).
    """

    def __init__(self, agent: Any, collector: Any, *, publish_every: int = 1, lr_warmup: int = 0):
        self.agent = agent
        self.route = direct_route
        #: updates over which the policy's lr rises linearly to ``agent.cfg.lr`` (0: none)
        self.lr_warmup = int(lr_warmup)
        self.policy = agent.policy
        self.collector = collector
        self.publish_every = int(publish_every)
        self.updates = 0
        self.rounds = 0
        self.version = 0
        self._publish = False
        self._after: Callable[[], None] | None = None

    def step(self) -> dict[str, float] | None:
        if self._after is not None:  # the last round's epilogue, once its version is out
            self._after()
            self._after = None
        self._publish = False
        t0 = time.monotonic()
        got = self.collector.collect(self.version)
        if got is None:
            return None
        self.rounds += 1
        metrics = dict(got.metrics)
        if got.batch is not None and self.agent.has_trainable_chunks(got.batch):
            t_up = time.monotonic()
            if self.lr_warmup > 0:
                metrics["lr"] = self._warm_lr()
            metrics.update(self.agent.update(self.route(got.batch)))
            metrics["update_s"] = time.monotonic() - t_up
            self.updates += 1
            if self.updates % self.publish_every == 0:
                self._publish = True
                self.version += 1
        self._after = got.done
        metrics.update(self._queue_metrics(), rounds=float(self.rounds),
                       policy_version=float(self.version), round_s=time.monotonic() - t0)
        return metrics

    def _warm_lr(self) -> float:
        """The policy group's lr for the coming update: ``cfg.lr * (u + 1) / lr_warmup``, capped
        at ``cfg.lr`` (Adam's first steps move every weight by about the lr, whatever its
        gradient, which knocks a BC-trained policy down); the value group is left alone."""
        lr = float(self.agent.cfg.lr) * min(1.0, (self.updates + 1) / self.lr_warmup)
        self.agent.opt.param_groups[0]["lr"] = lr
        return lr

    def _queue_metrics(self) -> dict[str, float]:
        st = self.collector.queue.status()
        return {f"rollouts_{k}": float(v) for k, v in st.items() if isinstance(v, (int, float))}

    def should_publish(self) -> bool:
        return self._publish

    def state_dict(self) -> dict:
        return {"agent": self.agent.state_dict(), "updates": self.updates, "rounds": self.rounds,
                "version": self.version, "collector": self.collector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.agent.load_state_dict(state["agent"])
        self.updates = int(state["updates"])
        self.rounds = int(state.get("rounds", self.updates))
        self.version = int(state.get("version", self.updates // self.publish_every))
        self.collector.load_state_dict(state.get("collector", {}))

