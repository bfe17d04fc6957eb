"""SAC under DeepSpeed (ZeRO-2/3): one engine per trained model (the rest of :mod:`agents.parallel`
does the preparing, stepping, reducing and gathering). SAC's own maths stays in :mod:`agents.sac`:
its phase dispatch comes in as ``run_phase``.

SAC steps its actor, critic ensemble and temperature separately, and one DeepSpeed engine
steps one optimizer over all of its parameters (Adam moves parameters whose gradient is zero
through their moments), so the parts cannot share an engine. Here the actor (the policy) and
the critic ensemble each go through their own ``accelerator.prepare`` call and become two
engines with their own optimizers. accelerate >= 1.x allows one DeepSpeed model per
``prepare`` call; both engines use the one DeepSpeed plugin of the launch
(the launch's ZeRO config: the same stage, bf16, gradient clipping), so accelerate's
dict of named plugins is not needed. ``accelerator.backward``
only knows the first engine, so each step calls its engine's ``backward`` and ``step``
directly (the engine clips by its config's ``gradient_clipping``; ``max_grad_norm`` is not
used under DeepSpeed: :func:`agents.parallel.engine_step`).

The temperature (one scalar) stays a plain local parameter with its own Adam: its gradient
is averaged over the ranks (:func:`agents.parallel.average_grads`) before the step, so it stays
equal everywhere.

The target critic is **unsharded by choice**: a whole fp32 copy on every rank (it only runs
forwards), updated by the soft update from the online critic after each critic step, under
ZeRO-3 inside ``GatheredParameters`` (a collective every critic step: cheap for SAC's small
critics, the reason to keep it whole rather than sharding it too). A critic over a VLA's
frozen features holds the policy by reference, not as parameters, so the two engines never
share a parameter; ``critic_encoder=shared`` (the critic trains the policy's encoder) would,
and is refused.

bf16 engines hold bf16 weights while batches stay float32: forwards run under autocast
(as :class:`agents.ppo.agent.PolicyCalls` does) and return float32.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from agents import parallel
from agents.base import Batch
from agents.parallel import low_precision_autocast


class ActorCalls(nn.Module):
    """The policy's reparameterised sample as the engine's forward."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, batch: Batch, prefix: str = ""):
        with low_precision_autocast(self):
            a, logp = self.policy.sample(batch, prefix)
        return a.float(), logp.float()


class CriticCalls(nn.Module):
    """The critic ensemble's Q(s, a) [E, B] as the engine's forward."""

    def __init__(self, critic: nn.Module):
        super().__init__()
        self.critic = critic

    def forward(self, batch: Batch, actions: torch.Tensor, prefix: str = ""):
        with low_precision_autocast(self):
            q = self.critic(batch, actions, prefix)
        return q.float()


class SACEngines:
    """SAC's phases (as :class:`agents.sac.agent.SACModel`'s ``forward``) over the two engines.

    The actor phase scores the actor's actions with the critic module itself, not through the
    critic engine: a DeepSpeed engine whose forward is part of a graph runs its own gradient
    reduction at the end of that graph's backward ("torch-style backward", DeepSpeed >= 0.18),
    which for the frozen critic has nothing to reduce and fails. Under ZeRO-3 the critic's
    parameters are still gathered for that forward by the hooks ZeRO-3 puts on every submodule."""

    def __init__(self, actor, critic, temperature: nn.Module, critic_raw: nn.Module, run_phase: Callable):
        self.actor, self.critic, self.temperature, self.critic_raw = actor, critic, temperature, critic_raw
        self.run_phase = run_phase

    def __call__(self, batch: Batch, what: str, actions: torch.Tensor | None = None, prefix: str = ""):
        return self.run_phase(what, batch, actions, prefix, sample=self.actor, critic=self.critic,
                         temperature=self.temperature, score=self._score,
                         unknown="SAC phase {!r} is not available under DeepSpeed")

    def _score(self, batch: Batch, a: torch.Tensor) -> torch.Tensor:
        with low_precision_autocast(self.critic_raw):
            return self.critic_raw(batch, a).float()


def prepare_sac_engines(agent: Any, policy: nn.Module, actor_params: list, critic: nn.Module,
                        temperature: nn.Module, run_phase: Callable) -> None:
    """Sets what :func:`agents.sac.agent.prepare_sac` sets, with two engines (module docstring);
    ``agent.engines`` = (actor engine, critic engine); ``run_phase``: SAC's phase dispatch
    (:func:`agents.sac.phases.run_phase`)."""
    acc, cfg = agent.accelerator, agent.cfg
    if cfg.critic_encoder == "shared":
        raise ValueError("critic_encoder=shared trains the policy's encoder from the critic: under "
                         "DeepSpeed the actor and critic engines would share those parameters. Use "
                         f"critic_encoder=own or policy, or {parallel.DDP_HINT}")
    dev = acc.device
    target = copy.deepcopy(critic).float().to(dev)  # whole, before prepare may shard the critic
    target.requires_grad_(False)
    temperature.to(dev)
    actor_opt = torch.optim.AdamW(actor_params, lr=cfg.actor_lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=cfg.critic_lr,
                                   weight_decay=0.0)
    actor_engine, agent.actor_opt = parallel.prepare_engine(acc, ActorCalls(policy).to(dev), actor_opt)
    critic_engine, agent.critic_opt = parallel.prepare_engine(acc, CriticCalls(critic).to(dev), critic_opt)
    agent.temp_opt = torch.optim.Adam(temperature.parameters(), lr=cfg.temp_lr)
    agent.engines = (actor_engine, critic_engine)
    agent.model = SACEngines(actor_engine, critic_engine, temperature, critic, run_phase)
    agent._actor_raw, agent._critic_raw, agent._temp_raw = policy, critic, temperature
    agent.critic, agent.temperature = critic, temperature
    # prepare broadcast rank 0's weights into the engines: the target starts from them
    parallel.gathered_soft_update(target, critic, 1.0, acc, copy_whole=True)
    agent.target_critic = target
    agent.steps = EngineSteps(agent)


def critic_update(agent: Any, loss: torch.Tensor) -> None:
    """Backward and step of the critic engine, then the target's soft update."""
    parallel.engine_step(agent.engines[1], loss)
    parallel.gathered_soft_update(agent.target_critic, agent._critic_raw, agent.cfg.tau, agent.accelerator)


def actor_update(agent: Any, loss: torch.Tensor) -> None:
    """Backward of actor + temperature loss through the actor engine, the temperature's
    gradient averaged over the ranks, the actor engine's step (the caller steps temp_opt)."""
    parallel.engine_step(agent.engines[0], loss,
                         before_step=lambda: parallel.average_grads(agent._temp_raw.parameters()))


def state_dict(agent: Any) -> dict:
    """Weights gathered (every rank calls this together), the target critic, log_alpha, the
    temperature's optimizer and the counter; the engines' optimizers are in their own files."""
    out: dict[str, Any] = {}
    for name, mod in (("policy", agent._actor_raw), ("critic", agent._critic_raw)):
        out[name] = parallel.gathered_state(mod, agent.accelerator, cpu=True)
    out.update(target_critic={k: v.detach().clone() for k, v in agent.target_critic.state_dict().items()},
               log_alpha=agent._temp_raw.log_alpha.detach().clone(),
               temp_opt=copy.deepcopy(agent.temp_opt.state_dict()), num_updates=int(agent.num_updates))
    return out


def load_state_dict(agent: Any, state: dict) -> None:
    for name, mod in (("policy", agent._actor_raw), ("critic", agent._critic_raw)):
        parallel.load_gathered(mod, agent.accelerator, state[name])
    agent.target_critic.load_state_dict(state["target_critic"])
    with torch.no_grad():
        agent._temp_raw.log_alpha.copy_(state["log_alpha"])
    if "temp_opt" in state:
        agent.temp_opt.load_state_dict(copy.deepcopy(state["temp_opt"]))
    agent.num_updates = int(state["num_updates"])


class EngineSteps:
    """SAC's optimizer steps and checkpoint state over the two engines (as
    :class:`agents.sac.agent.LocalSteps` without them)."""

    def __init__(self, agent: Any):
        self.agent = agent

    def critic(self, loss: torch.Tensor) -> None:
        critic_update(self.agent, loss)

    def actor(self, loss: torch.Tensor) -> None:
        actor_update(self.agent, loss)

    def state_dict(self) -> dict:
        return state_dict(self.agent)

    def load_state_dict(self, state: dict) -> None:
        load_state_dict(self.agent, state)

