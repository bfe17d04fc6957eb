"""One place for DDP and DeepSpeed: how an algorithm's trained modules are prepared, stepped,
reduced over the ranks and gathered whole. Algorithms call these and hold no engine branch.

- **prepare**: :func:`prepare` (one module and its optimizers through ``accelerator.prepare``;
  under DeepSpeed, one engine with one optimizer), :func:`prepare_engine` (one engine per
  trained model), :func:`engines` (the engines to checkpoint: none without DeepSpeed);
- **step**: :func:`backward_step` (backward, clip, and the engine's step under DeepSpeed),
  :func:`engine_step`, :func:`clip`, :func:`average_grads` (a local parameter's gradient
  averaged over the ranks);
- **reduce**: :func:`world`, :func:`whiten_over_ranks`, :func:`rank_scale`,
  :func:`mean_over_ranks`;
- **gather**: :func:`zero3_gathered`, :func:`gathered_state`, :func:`load_gathered`,
  :func:`gathered_soft_update`, and :func:`whole_weights` for building models whole.

Without DeepSpeed (one process, or DDP) every helper is the plain single-process operation.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

#: what a refusal tells the user to switch to
DDP_HINT = "deepspeed.stage=0 (DDP)"


# -- the accelerator ------------------------------------------------------------------------------
def accelerator_kwargs() -> list:
    """The ``kwargs_handlers`` every learner ``Accelerator`` is made with. The algorithms put
    their trained parts behind one wrapper module whose forward runs one *phase* (SAC: the
    critic phase touches only the critic, the actor phase only the actor and temperature), so
    under DDP some parameters get no gradient in a given backward: DDP must look for them
    (``find_unused_parameters``) instead of waiting for their gradients forever."""
    from accelerate.utils import DistributedDataParallelKwargs

    return [DistributedDataParallelKwargs(find_unused_parameters=True)]


def uses_deepspeed(accelerator: Any) -> bool:
    """True when ``accelerator`` prepares models as DeepSpeed engines."""
    from accelerate.utils import DistributedType

    return getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED


#: the name algorithms use: whether their modules are prepared as engines
uses_engines = uses_deepspeed


def is_zero3(accelerator: Any) -> bool:
    """True when ``accelerator`` shards parameters with DeepSpeed ZeRO-3."""
    plugin = accelerator.state.deepspeed_plugin if uses_deepspeed(accelerator) else None
    return plugin is not None and int(plugin.zero_stage) == 3


def refuse_engines(accelerator: Any, why: str) -> None:
    """Raise ``why`` (a sentence naming what does not run under DeepSpeed) with the DDP hint
    when ``accelerator`` uses DeepSpeed."""
    if uses_deepspeed(accelerator):
        raise ValueError(f"{why}: run it multi-GPU with {DDP_HINT}")


# -- prepare ---------------------------------------------------------------------------------------
def prepare(accelerator: Any, module: torch.nn.Module, optimizers: Callable[[], Sequence],
            *, engine_optimizer: Callable[[], Any] | None = None, slots: int = 1) -> tuple:
    """``module`` and the optimizers ``optimizers()`` makes through ``accelerator.prepare``;
    under DeepSpeed (one engine, one optimizer) ``engine_optimizer()`` instead when given.
    Returns (prepared module, optimizer 1, ... optimizer ``slots``), None where there is none."""
    one_engine = engine_optimizer is not None and uses_deepspeed(accelerator)
    opts = [engine_optimizer()] if one_engine else list(optimizers())
    out = accelerator.prepare(module, *opts)
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    return tuple(out) + (None,) * (slots + 1 - len(out))


def prepare_engine(accelerator: Any, module: torch.nn.Module, optimizer: Any) -> tuple:
    """One DeepSpeed engine per trained model: (engine, optimizer) of ``module`` alone."""
    return accelerator.prepare(module, optimizer)


def engines(accelerator: Any, *models: Any) -> list:
    """The DeepSpeed engines among ``models`` (what a checkpoint saves per rank); [] without."""
    return [m for m in models if m is not None] if uses_deepspeed(accelerator) else []


# -- step ------------------------------------------------------------------------------------------
def clip(accelerator: Any, params, max_grad_norm: float | None) -> torch.Tensor | None:
    """Clip the global gradient norm of ``params`` (None: no clipping); the norm before it."""
    if max_grad_norm is None:
        return None
    norm = accelerator.clip_grad_norm_(params, max_grad_norm)
    return None if norm is None else torch.as_tensor(norm).detach().float()


def backward_step(accelerator: Any, model: Any, loss: torch.Tensor, clip_params,
                  max_grad_norm: float | None) -> torch.Tensor | None:
    """The backward of ``loss`` through ``model`` (what :func:`prepare` returned), then under
    DeepSpeed the engine's own clip and step (``accelerator.backward`` drives only the first
    engine an accelerator prepared; the optimizer's ``step()`` is then a no-op), else the clip
    of ``clip_params`` (the caller steps the optimizer). Returns the gradient norm or None."""
    if uses_deepspeed(accelerator):
        model.backward(loss)
        model.step()
        gn = model.get_global_grad_norm()
        return None if gn is None else torch.as_tensor(float(gn))
    accelerator.backward(loss)
    return clip(accelerator, clip_params, max_grad_norm)


def engine_step(engine: Any, loss: torch.Tensor, before_step: Callable[[], None] | None = None) -> None:
    """Backward and step of one engine of :func:`prepare_engine` (it clips by its config);
    ``before_step`` runs between them."""
    engine.backward(loss)
    if before_step is not None:
        before_step()
    engine.step()


def average_grads(params) -> None:
    """Average the gradients of local (unprepared) parameters over the ranks, so that their
    optimizer steps keep them equal everywhere; nothing on one process."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size > 1:
        for p in params:
            if p.grad is not None:  # gloo has no AVG: sum, then divide
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(world_size)


# -- reduce ----------------------------------------------------------------------------------------
def world(accelerator: Any) -> int:
    return int(accelerator.num_processes)


def whiten_over_ranks(accelerator: Any, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked whitening with the statistics of the *global* batch (all ranks' shares), so N
    ranks normalise as one process would (N > 1; one process: the local masked whitening)."""
    m = mask.to(adv.dtype)
    tot = accelerator.reduce(torch.stack([(adv * m).sum(), m.sum()]), "sum")
    mean = tot[0] / tot[1].clamp_min(1.0)
    var = accelerator.reduce(((adv - mean).pow(2) * m).sum(), "sum") / (tot[1] - 1.0).clamp_min(1.0)
    return (adv - mean) / (var.sqrt() + 1e-6) * m


def rank_scale(accelerator: Any, mask: torch.Tensor) -> torch.Tensor | float:
    """Factor on a rank's masked-mean loss so that DDP's mean over ranks is the masked mean
    over the global minibatch (ranks whose shares hold different numbers of real rows); 1 on
    one process."""
    if accelerator.num_processes == 1:
        return 1.0
    local = mask.float().sum()
    total = accelerator.reduce(local.detach().clone(), "sum")
    return local.clamp_min(1.0) * accelerator.num_processes / total.clamp_min(1.0)


def mean_over_ranks(accelerator: Any, value, device: torch.device) -> float:
    """The mean of a float over the ranks (the value itself on one process)."""
    t = torch.as_tensor(value, device=device, dtype=torch.float32)
    return float(accelerator.reduce(t, "mean") if accelerator.num_processes > 1 else t)


# -- gather ----------------------------------------------------------------------------------------
def zero3_gathered(params: Any, accelerator: Any, *, modifier_rank: int | None = None):
    """A context in which ``params`` (a module's parameters, or a list of them) are whole under
    DeepSpeed ZeRO-3 (every rank must enter it together; ``modifier_rank`` = the rank whose
    writes are kept), else a no-op."""
    if not is_zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed

    params = list(params.parameters()) if isinstance(params, torch.nn.Module) else list(params)
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def gathered_state(module: torch.nn.Module, accelerator: Any, *, cpu: bool = False) -> dict:
    """A copy of ``module``'s state dict, whole (every rank calls it together under ZeRO-3)."""
    with zero3_gathered(module, accelerator):
        return {k: (v.detach().clone().cpu() if cpu else v.detach().clone())
                for k, v in module.state_dict().items()}


def load_gathered(module: torch.nn.Module, accelerator: Any, state: dict) -> None:
    """Load a whole state dict into ``module`` (rank 0's writes kept under ZeRO-3)."""
    with zero3_gathered(module, accelerator, modifier_rank=0):
        module.load_state_dict(state)


@torch.no_grad()
def gathered_soft_update(target: torch.nn.Module, online: torch.nn.Module, tau: float,
                         accelerator: Any, *, copy_whole: bool = False) -> None:
    """target <- tau * online + (1 - tau) * target (``copy_whole``: target <- online), the
    online module gathered whole under ZeRO-3; the target is a plain local fp32 module."""
    with zero3_gathered(online, accelerator):
        tp, op = list(target.parameters()), [p.detach().float() for p in online.parameters()]
        if copy_whole:
            for t, o in zip(tp, op):
                t.copy_(o)
        else:
            torch._foreach_lerp_(tp, op, tau)
        for tb, ob in zip(target.buffers(), online.buffers()):
            tb.copy_(ob)


@contextlib.contextmanager
def whole_weights():
    """Build modules whole inside, also under DeepSpeed ZeRO-3.

    accelerate registers its ZeRO-3 config with transformers, which then constructs every
    model inside ``deepspeed.zero.Init``: parameters are partitioned as they are made, so the
    policies' own initialisation (lerobot's and OFT's heads, LoRA) meets empty shards ("Fan in
    and fan out can not be computed ..."). Policies are built whole on each rank instead
    and ``accelerator.prepare`` partitions them.
    Without a ZeRO-3 config this does nothing."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # no transformers: nothing registers a ZeRO-3 config
        yield
        return
    ref = hf_ds._hf_deepspeed_config_weak_ref  # noqa: SLF001 - the registered config, to restore
    held = ref() if ref is not None else None
    if held is None or not hf_ds.is_deepspeed_zero3_enabled():
        yield
        return
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds.set_hf_deepspeed_config(held)


def low_precision_autocast(module: torch.nn.Module):
    """Autocast to the dtype of ``module``'s weights when they are bf16/fp16 on a GPU (a
    DeepSpeed bf16 engine casts a module's weights while batches stay float32), else a no-op."""
    p = next(module.parameters(), None)
    low = p is not None and p.is_cuda and p.dtype in (torch.bfloat16, torch.float16)
    return torch.autocast("cuda", dtype=p.dtype) if low else contextlib.nullcontext()
