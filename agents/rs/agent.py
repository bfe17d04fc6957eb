"""Rejection sampling (Hi-ORS-style): behaviour cloning on what is worth keeping.

Online episodes are scored by their outcome (the success flag, which the env, a reward
classifier on the actor or a person's label sets; or ``return >= return_threshold``); the
successful ones are kept, the failures rejected, and the steps a person drove
(``intervened``) are kept from every episode (HG-DAgger). The policy is trained with its
own ``bc_loss(batch)`` (:class:`agents.base.BCPolicy`) on batches of the kept transitions,
with demonstrations mixed in. Any BCPolicy works: the MLP's tanh-Gaussian NLL, PI0's flow
matching, OpenVLA-OFT's L1 or token cross-entropy.

This file is the configuration and the update itself: :func:`cosine_lr`,
:func:`episode_outcome`, :func:`keep_version` and :func:`bc_inputs` are pure functions;
:class:`BCAgent.update` is one gradient step on one batch (no files, sockets or logging).
The cycle (collect ``env_steps_per_cycle`` env steps -> ``sft_steps_per_cycle`` BC steps ->
publish -> evaluate -> keep or roll back) is :mod:`agents.rs.learning`'s, the success store
:mod:`agents.rs.data`'s and the evaluation jobs :mod:`agents.rs.jobs`'.

Chunked policies (``chunk_size`` H > 1) train on windows of H steps (``action`` [B, H, A],
see :meth:`data.replay.ReplayBuffer.sample` with ``horizon``); steps past an episode's end
are marked ``action_is_pad`` [B, H] (PI0 and OFT ignore them; the MLP's NLL has no mask and
sees the padded copies of the last action). A window is admitted by its first step: a
window starting at a person's step of a failed episode may carry policy steps after the
person let go.

Several ranks (``launch/run_learner.sh --gpus N``, DDP or DeepSpeed ZeRO): rank 0 samples the
global batch (demos mixed in) and :class:`learner.distributed.RootRoute` scatters equal row
blocks; the learning rate of each step travels inside the batch as the column :data:`BC_LR`
(one value repeated per row), so every rank steps with rank 0's schedule; DDP / the engine
average the gradients, so N ranks take the step one process takes on the whole batch. The
keep/roll-back gate restores weights on rank 0 and broadcasts them (``sync_weights`` of the
route), under DDP only (:class:`BCAgent` refuses the gate under DeepSpeed).

What it has learned (the MLP and a tiny PI0 on ``env=point_reach``, with and without the
scripted expert's corrections, and the pre-registered ``point_reach_vl`` runs against a
demos-only control): docs/learning.md, with the commands (tools/experiments/rs_pi0_learning.py,
tools/experiments/rs_vl_learning.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agents import parallel
from agents.base import Batch, BCPolicy, check_pair
from agents.common.policy_calls import take, to_device

LR_SCHEDULES = ("cycle", "run", "constant")
#: the batch column that carries a BC step's learning rate to every rank ([B] float64, one value)
BC_LR = "bc_lr"
OUTCOMES = ("success", "return", "either")


@dataclass
class RejectionSamplingConfig:
    """Hyperparameters of rejection sampling and its cadence; ``config/algo/rejection_sampling.yaml``
    holds the defaults (tuned for the CPU demo: MLP on ``env=point_reach``)."""

    # -- the BC update --
    #: transitions (chunk windows for chunked policies) per BC batch
    batch_size: int = 64
    #: split each batch into pieces of this many rows, one backward each and one optimizer step
    #: (gradient accumulation; full-size PI0 at batch 64 does not fit an 80 GB GPU); None: whole
    micro_batch_size: int | None = None
    #: peak learning rate (AdamW) of the cosine schedule
    lr: float = 1e-3
    #: final learning rate of the cosine schedule
    lr_min: float = 1e-4
    #: "cycle": cosine from lr to lr_min over each cycle's ``sft_steps_per_cycle`` steps
    #: (restarting every cycle, Hi-ORS); "run": one cosine over ``lr_decay_steps`` BC steps
    #: of the whole run (pretraining excluded), lr_min after; "constant": lr throughout
    lr_schedule: str = "cycle"
    #: length of the "run" schedule in BC steps (ignored otherwise)
    lr_decay_steps: int = 10000
    #: AdamW weight decay
    weight_decay: float = 0.0
    #: clip the global gradient norm to this value (None: no clipping)
    max_grad_norm: float | None = 1.0
    #: fraction of each batch drawn from the demos (``buffer.demos``); None: ``buffer.demo_ratio``.
    #: While the success store is empty the demos fill the batch, and the other way round
    demo_ratio: float | None = 0.5
    # -- pretraining --
    #: BC steps on the demos alone (cosine lr -> lr_min over them) before the first version
    #: goes out; 0: start from the policy as built (needs ``buffer.demos`` when > 0)
    pretrain_steps: int = 0
    # -- the cycle --
    #: new env steps (evaluation episodes excluded) that trigger a training cycle
    env_steps_per_cycle: int = 300
    #: BC steps per cycle; a new weights version is published after the last one
    sft_steps_per_cycle: int = 100
    # -- what is kept --
    #: an episode's outcome: "success" (its final success flag: env, reward classifier or a
    #: person's label), "return" (its return >= ``return_threshold``) or "either"
    success_from: str = "success"
    #: the return an episode needs when ``success_from`` is "return" or "either"
    return_threshold: float = 0.0
    #: keep the steps a person drove (``intervened``) of every episode, failed ones too (HG-DAgger)
    keep_interventions: bool = True
    #: train on successful evaluation episodes too (false: evaluation stays held out)
    train_on_eval: bool = False
    # -- evaluation: deterministic learner jobs after each new version --
    #: evaluation episodes per task when ``eval_init_states`` is empty (init states 0..n-1);
    #: 0 disables evaluation (every new version is kept)
    eval_episodes: int = 10
    #: explicit init states to evaluate (each with every task of ``eval_task_ids``)
    eval_init_states: tuple[int, ...] = ()
    #: task ids the evaluation jobs run
    eval_task_ids: tuple[int, ...] = (0,)
    #: the reset seed of every evaluation job (the init state fixes the start anyway)
    eval_seed: int = 0
    #: keep a new version when its success >= best so far - tolerance, else roll back to
    #: the best weights
    eval_tolerance: float = 0.0
    #: evaluate the starting version (after pretraining) as the first "best"
    eval_initial: bool = True
    #: give up waiting for evaluation episodes after this long and decide on those that
    #: arrived (none: keep the version)
    eval_timeout_s: float = 600.0
    #: reset the optimizer's moments when rolling back
    reset_optimizer_on_rollback: bool = True

    def validate(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.success_from not in OUTCOMES:
            raise ValueError(f"success_from must be one of {OUTCOMES}, got {self.success_from!r}")
        if self.batch_size < 1 or self.sft_steps_per_cycle < 1 or self.env_steps_per_cycle < 1:
            raise ValueError("batch_size, sft_steps_per_cycle and env_steps_per_cycle must be >= 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")
        if self.pretrain_steps < 0 or self.eval_episodes < 0 or self.lr_decay_steps < 1:
            raise ValueError("pretrain_steps and eval_episodes must be >= 0, lr_decay_steps >= 1")
        if not 0 < self.lr_min <= self.lr:
            raise ValueError(f"need 0 < lr_min <= lr, got lr={self.lr}, lr_min={self.lr_min}")
        if self.demo_ratio is not None and not 0.0 <= self.demo_ratio <= 1.0:
            raise ValueError(f"demo_ratio must be in [0, 1], got {self.demo_ratio}")
        if not self.eval_task_ids:
            raise ValueError("eval_task_ids must name at least one task")

    @property
    def requires(self) -> tuple[type, ...]:
        return (BCPolicy,)

    def eval_jobs(self) -> list[tuple[int, int]]:
        """(task_id, init_state) of every evaluation episode, in order."""
        states = list(self.eval_init_states) or list(range(self.eval_episodes))
        if not self.eval_init_states and self.eval_episodes == 0:
            return []
        return [(int(t), int(s)) for t in self.eval_task_ids for s in states]


# -- pure functions ----------------------------------------------------------------------------
def cosine_lr(step: int, total: int, lr: float, lr_min: float) -> float:
    """Cosine decay from ``lr`` (step 0) to ``lr_min`` (step ``total`` - 1 and after)."""
    if total <= 1:
        return lr if step <= 0 else lr_min
    t = min(max(step, 0), total - 1) / (total - 1)
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * t))


def scheduled_lr(cfg: RejectionSamplingConfig, cycle_step: int, sft_updates: int) -> float:
    """The learning rate of a cycle's BC step ``cycle_step`` (0-based) when ``sft_updates``
    cycle steps were taken before it in the run."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "cycle":
        return cosine_lr(cycle_step, cfg.sft_steps_per_cycle, cfg.lr, cfg.lr_min)
    return cosine_lr(sft_updates, cfg.lr_decay_steps, cfg.lr, cfg.lr_min)


def episode_outcome(success: bool, episode_return: float, cfg: RejectionSamplingConfig) -> bool:
    """Whether an episode is kept, from its final success flag and its return."""
    by_return = episode_return >= cfg.return_threshold
    if cfg.success_from == "success":
        return bool(success)
    if cfg.success_from == "return":
        return bool(by_return)
    return bool(success or by_return)


def keep_version(success: float, best: float, tolerance: float) -> bool:
    """Hi-ORS's evaluation gate: keep the new version when its success rate is at least the
    best so far minus ``tolerance``; otherwise roll back to the best weights."""
    return success >= best - tolerance


def bc_inputs(batch: Batch) -> Batch:
    """A replay batch as ``bc_loss`` reads it: chunk windows get ``action_is_pad`` [B, H]
    (the steps past the episode's end, ``~step_mask``)."""
    if "step_mask" in batch and "action_is_pad" not in batch:
        batch = {**batch, "action_is_pad": ~batch["step_mask"].bool()}
    return batch


def with_lr(batch: Batch, lr: float) -> Batch:
    """``batch`` with its step's learning rate as the column :data:`BC_LR` (what the ranks'
    shares all carry: :class:`learner.distributed.RootRoute` splits every column by rows)."""
    rows = len(next(iter(batch.values())))
    return {**batch, BC_LR: torch.full((rows,), float(lr), dtype=torch.float64)}


class BCLoss(torch.nn.Module):
    """The policy's ``bc_loss`` as the ``forward`` of the module ``accelerator.prepare``
    returns, so the BC gradient is all-reduced across ranks (DDP) or goes through the
    sharded engine; calling the unwrapped policy's ``bc_loss`` would skip both. Under a
    DeepSpeed engine (``engine``) the forward runs under autocast to the weights' dtype when
    the engine made them bf16 (batches stay float32); elsewhere the policy's own dtypes rule."""

    def __init__(self, policy: torch.nn.Module, *, engine: bool = False):
        super().__init__()
        self.policy = policy
        self.engine = engine

    def forward(self, batch: Batch) -> torch.Tensor:
        if not self.engine:
            return self.policy.bc_loss(batch)
        with parallel.low_precision_autocast(self.policy):
            return self.policy.bc_loss(batch).float()


class BCAgent:
    """The policy and its optimizer; :meth:`update` is one BC step on one batch at a given
    learning rate. The policy goes through ``accelerator.prepare`` as a :class:`BCLoss` and
    every loss is computed through it; ``policy`` stays the unwrapped module (what weight
    broadcasts read)."""

    name = "rejection_sampling"

    def __init__(self, cfg: RejectionSamplingConfig, policy, accelerator: Any):
        check_pair(self.name, cfg.requires, type(policy).__name__, policy)
        self.cfg = cfg
        self.accelerator = accelerator
        self.device = accelerator.device
        self.policy = policy
        policy.to(self.device)
        policy.train()
        self._params = [p for p in policy.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError(f"{type(policy).__name__} has no trainable parameters")
        #: DeepSpeed ZeRO: the engine steps inside the backward, holds the optimizer state
        #: (checkpointed per rank) and clips by its config's gradient_clipping
        self.engines = parallel.uses_engines(accelerator)
        if self.engines and cfg.eval_jobs():
            raise ValueError("algo=rejection_sampling: the keep/roll-back gate (algo.eval_episodes > 0 or "
                             "algo.eval_init_states) restores earlier weights, which a DeepSpeed engine's "
                             "optimizer partitions would overwrite: set algo.eval_episodes=0, or run "
                             f"several ranks with {parallel.DDP_HINT}")
        opt = self._make_optimizer()
        self._model, self.opt = accelerator.prepare(BCLoss(policy, engine=self.engines), opt)
        self._raw = policy
        # the ranks the engine or DDP averages gradients over (torch.distributed's count: an
        # accelerator on DeepSpeed's CPU accelerator reports 1 process while DeepSpeed reduces over all)
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _make_optimizer(self) -> torch.optim.Optimizer:
        # an engine flattens the parameters into its own partitions: a plain AdamW there
        fused = self.device.type in ("cpu", "cuda") and not self.engines
        return torch.optim.AdamW(self._params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                 fused=fused)

    def reset_optimizer(self) -> None:
        """Forget the moments (after a roll-back): a fresh state for every parameter."""
        self.opt.state.clear()

    def update(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """One BC step on ``batch`` at learning rate ``lr`` (None: the batch's :data:`BC_LR`
        column, :func:`with_lr`); float metrics. With ``micro_batch_size``, the gradient of the
        batch's loss is accumulated over pieces of that many rows, each piece's loss weighted
        by its share of the rows. On N ranks ``batch`` is this rank's share and ``bc_loss``
        the mean over the ranks (the whole batch's loss: the shares are equal)."""
        if BC_LR in batch:
            batch = dict(batch)
            carried = batch.pop(BC_LR)
            lr = float(carried[0]) if lr is None else lr
        if lr is None:
            raise ValueError(f"BCAgent.update needs a learning rate (lr= or the batch's {BC_LR!r} column)")
        batch = bc_inputs(to_device(batch, self.device))
        for g in self.opt.param_groups:
            g["lr"] = float(lr)
        self._raw.train()
        metrics: dict[str, float] = {}
        if self.engines:
            self._pieces(batch)  # refuses micro_batch_size under an engine
            loss = self._model(batch)
            norm = parallel.backward_step(self.accelerator, self._model, loss, self._params, None)
            loss_sum = float(loss.detach())
            if norm is not None:
                metrics["grad_norm"] = float(norm)
        else:
            self.opt.zero_grad(set_to_none=True)
            pieces = self._pieces(batch)
            loss_sum = 0.0
            for i, (part, share) in enumerate(pieces):
                last = i == len(pieces) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(self._model):
                    loss = self._model(part)
                    self.accelerator.backward(loss * share if len(pieces) > 1 else loss)
                loss_sum += float(loss.detach()) * share
            if len(pieces) > 1:
                metrics["micro_batches"] = float(len(pieces))
            if self.cfg.max_grad_norm is not None:
                norm = self.accelerator.clip_grad_norm_(self._params, self.cfg.max_grad_norm)
                metrics["grad_norm"] = float(norm)
            self.opt.step()
        if self._world > 1:  # the whole batch's loss: the mean of the ranks' equal shares'
            t = torch.tensor([loss_sum], dtype=torch.float32, device=self.device)
            dist.all_reduce(t)
            loss_sum = float(t) / self._world
        metrics.update(bc_loss=loss_sum, lr=float(lr))
        if "is_demo" in batch:
            metrics["demo_fraction"] = float(batch["is_demo"].float().mean())
        return metrics

    def _pieces(self, batch: Batch) -> list[tuple[Batch, float]]:
        """[(rows s..s+m of the batch, m / n)]; one piece without ``micro_batch_size``."""
        m = self.cfg.micro_batch_size
        n = len(next(iter(batch.values())))
        if not m or m >= n:
            return [(batch, 1.0)]
        if parallel.uses_deepspeed(self.accelerator):
            raise ValueError("algo.micro_batch_size: with sharded engines (ZeRO) set gradient_accumulation_steps in the "
                             "config instead (its engine steps inside every backward)")
        return [(take(batch, torch.arange(s, min(s + m, n), device=self.device)), min(m, n - s) / n)
                for s in range(0, n, m)]

    # -- weights and checkpoints --------------------------------------------------------------
    def trainable(self) -> dict[str, torch.Tensor]:
        """The trainable weights; under ZeRO-3 gathered whole (every rank calls it together)."""
        if parallel.is_zero3(self.accelerator):
            with parallel.zero3_gathered(self._params, self.accelerator):
                return {k: v.detach().clone() for k, v in self._raw.trainable_state_dict().items()}
        return self._raw.trainable_state_dict()

    def load_trainable(self, state: dict[str, torch.Tensor]) -> None:
        with parallel.zero3_gathered(self._params, self.accelerator, modifier_rank=0):
            self._raw.load_trainable_state_dict(state)
        self._raw.train()

    def parallel_engines(self) -> list:
        """The DeepSpeed engine training the policy, for checkpoints; [] without engines."""
        return parallel.engines(self.accelerator, self._model)

    def state_dict(self) -> dict:
        """The trainable weights (a VLA's frozen backbone is rebuilt from its checkpoint) and
        the optimizer (under an engine: the engine's own checkpoint, learner/engine_state.py)."""
        if self.engines:
            return {"policy": self.trainable()}
        return {"policy": self.trainable(), "opt": copy.deepcopy(self.opt.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.load_trainable(state["policy"])
        if "opt" in state and not self.engines:  # an engine loads its own
            self.opt.load_state_dict(copy.deepcopy(state["opt"]))
