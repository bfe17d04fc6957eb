"""Real-time chunking (RTC, Black et al. 2025) for the flow policies: the settings, the
per-row request (pending prefix and delay), and the guidance arithmetic of lerobot's
``RTCProcessor`` (``lerobot/policies/rtc/modeling_rtc.py``) in a form the batched fast path
(:mod:`agents.policies.pi0.fast`) runs with one tensor per row, inside a CUDA graph too.

A request row carries the actions of the current chunk that have not run yet (``prefix``
[H, A] in the env's action space, its first ``pending`` rows real) and the inference delay
``delay`` in control steps (the actions that will run while the new chunk is computed). The
new chunk is denoised with

- the first ``min(delay, pending)`` actions frozen: at every Euler step their noisy value is
  the prefix's (``t * noise + (1 - t) * prefix``), so the chunk's output there is the prefix;
- guidance of the rest toward the prefix, lerobot's: ``v <- v - w(t) * W * (prefix - x1)``
  with ``x1 = x - t * v`` the step's estimate of the clean chunk, ``W`` [H] lerobot's prefix
  weights (``get_prefix_weights(delay, min(execution_horizon, pending), H)``: 1 over the
  delay, decaying by ``prefix_attention_schedule`` to 0 at the execution horizon) and ``w(t)``
  lerobot's guidance weight clipped at ``max_guidance_weight``. lerobot sets ``requires_grad``
  on ``x`` after computing ``v``, so its autograd correction is ``err`` itself (the Jacobian
  of the velocity is not propagated); this is that arithmetic, without autograd.

A row with ``pending`` 0 has all weights 0 and nothing frozen: its velocity is the plain one
(``v - w * 0``), so rows without RTC share a batch (and a captured graph) unaffected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("tandem.policies.rtc")

#: lerobot's RTCAttentionSchedule names
SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")


@dataclass(frozen=True)
class RtcSettings:
    """The learner's ``rtc`` config section (lerobot's ``RTCConfig`` names)."""

    enabled: bool = False
    max_guidance_weight: float = 10.0
    prefix_attention_schedule: str = "LINEAR"
    execution_horizon: int = 10

    def __post_init__(self):
        if self.prefix_attention_schedule not in SCHEDULES:
            raise ValueError(f"rtc.prefix_attention_schedule must be one of {SCHEDULES}, "
                             f"got {self.prefix_attention_schedule!r}")
        if not self.max_guidance_weight > 0:
            raise ValueError(f"rtc.max_guidance_weight must be > 0, got {self.max_guidance_weight}")
        if self.execution_horizon < 0:
            raise ValueError(f"rtc.execution_horizon must be >= 0, got {self.execution_horizon}")

    @classmethod
    def from_config(cls, section) -> "RtcSettings":
        d = dict(section or {})
        return cls(enabled=bool(d.get("enabled", False)),
                   max_guidance_weight=float(d.get("max_guidance_weight", 10.0)),
                   prefix_attention_schedule=str(d.get("prefix_attention_schedule", "LINEAR")).upper(),
                   execution_horizon=int(d.get("execution_horizon", 10)))

    def processor(self):
        """lerobot's ``RTCProcessor`` with these settings (its weight schedule is used as is)."""
        from lerobot.configs import RTCAttentionSchedule
        from lerobot.policies.rtc.configuration_rtc import RTCConfig
        from lerobot.policies.rtc.modeling_rtc import RTCProcessor

        return RTCProcessor(RTCConfig(
            enabled=True, max_guidance_weight=self.max_guidance_weight, execution_horizon=self.execution_horizon,
            prefix_attention_schedule=RTCAttentionSchedule(self.prefix_attention_schedule)))


@dataclass
class RtcRows:
    """One batch's RTC inputs, a row per observation: ``prefix`` [B, H, A] float32 (env action
    space), ``delay`` [B] and ``pending`` [B] int64 (``pending`` 0: the row does not use RTC)."""

    prefix: np.ndarray
    delay: np.ndarray
    pending: np.ndarray
    settings: RtcSettings

    @property
    def any(self) -> bool:
        return bool((self.pending > 0).any())


def prefix_weights(rows: RtcRows, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, H] float32, frozen [B, H] bool): lerobot's prefix weights per row (its
    ``get_prefix_weights``, with the execution horizon clamped to the row's pending actions as
    its ``denoise_step`` does) and the frozen steps (``< min(delay, pending)``)."""
    proc = rows.settings.processor()
    b = len(rows.pending)
    weights = torch.zeros(b, horizon, dtype=torch.float32)
    frozen = torch.zeros(b, horizon, dtype=torch.bool)
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for i, (d, p) in enumerate(zip(rows.delay.tolist(), rows.pending.tolist(), strict=True)):
        if p <= 0:
            continue
        end = min(rows.settings.execution_horizon, p)
        key = (min(d, end), end)
        if key not in cache:
            w = proc.get_prefix_weights(d, end, horizon).float()
            cache[key] = torch.nn.functional.pad(w, (0, horizon - w.shape[0]))[:horizon]
        weights[i] = cache[key]
        frozen[i, :min(d, p)] = True
    return weights, frozen


def guidance_weights(times, max_guidance_weight: float) -> list[float]:
    """lerobot's guidance weight of each flow time ``t`` (1 -> 0; its ``tau = 1 - t``), its
    float32 expressions: ``min(c * inv_r2, max_guidance_weight)``."""
    out = []
    mx = torch.as_tensor(max_guidance_weight)
    for time_ in times:
        tau = torch.as_tensor(1 - float(time_))
        sq = (1 - tau) ** 2
        inv_r2 = (sq + tau ** 2) / sq
        c = torch.nan_to_num((1 - tau) / tau, posinf=float(mx))
        out.append(float(torch.minimum(torch.nan_to_num(c * inv_r2, posinf=float(mx)), mx)))
    return out


def guide(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor | float, gw: torch.Tensor,
          prefix: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One step's guided velocity (lerobot's ``denoise_step`` arithmetic): ``x``, ``v``,
    ``prefix`` [B, H, D], ``weights`` [B, H, 1], ``gw`` the step's guidance weight (0-d)."""
    x1 = x - t * v
    return v - gw * ((prefix - x1) * weights)


def freeze(x: torch.Tensor, t_next: torch.Tensor | float, noise: torch.Tensor, prefix: torch.Tensor,
           frozen: torch.Tensor) -> torch.Tensor:
    """The frozen steps of ``x`` at flow time ``t_next`` set to the noisy prefix
    (``frozen`` [B, H, 1] bool)."""
    return torch.where(frozen, t_next * noise + (1 - t_next) * prefix, x)


def check_rtc_pair(rtc: RtcSettings, algo_cfg, policy_cfg) -> None:
    """Refuse at start-up what RTC would make wrong: a flow-chain log-probability (the chain's
    actions are not the executed ones, and its density ignores the guidance) and noise-space
    SAC (the stored noise no longer determines the chunk: the prefix does too)."""
    if not rtc.enabled:
        return
    flow = (policy_cfg or {}).get("flow_rl")
    if flow:
        raise ValueError(f"rtc.enabled=true cannot be paired with policy.flow_rl={flow}: the flow chain's "
                         "log-probability (Flow-Noise/Flow-SDE PPO) would be computed for actions that did not "
                         "run and without the RTC guidance; set rtc.enabled=false or policy.flow_rl=null")
    if (algo_cfg or {}).get("name") == "sac_noise":
        raise ValueError("rtc.enabled=true cannot be paired with algo=sac_noise (noise-space SAC): "
                         "with RTC the chunk depends on the pending prefix, not only on the stored noise; "
                         "set rtc.enabled=false")
    name = str((policy_cfg or {}).get("name", ""))
    if not name.startswith("pi0"):
        raise ValueError(f"rtc.enabled=true needs a flow policy served by the PI0/PI0.5 fast path "
                         f"(policy=pi0, pi05, pi0_small), not policy={name}")
    steps = int((policy_cfg or {}).get("num_inference_steps", 10) or 10)
    if rtc.max_guidance_weight > steps:
        log.warning("rtc.max_guidance_weight=%g > policy.num_inference_steps=%d: the first Euler steps move "
                    "past the prefix (step size x guidance weight > 1); lerobot's defaults are 10 and 10",
                    rtc.max_guidance_weight, steps)


def rtc_inputs(rows: RtcRows, normalize, chunk: int, max_dim: int, num_steps: int,
               device: torch.device) -> dict:
    """The keyword arguments of :meth:`agents.policies.pi0.fast.FastPiSampler.sample` for
    ``rows``: the prefix normalised (``normalize``, the policy's action normaliser) and padded to
    ``max_dim``, the prefix weights [B, H, 1], the frozen steps [B, H, 1] and the guidance
    weight of each of the ``num_steps`` Euler steps."""
    prefix = torch.as_tensor(np.asarray(rows.prefix, np.float32))
    if prefix.ndim != 3 or prefix.shape[1] != chunk or prefix.shape[2] > max_dim:
        raise ValueError(f"RTC prefix must be [B, {chunk}, A<={max_dim}], got {list(prefix.shape)}")
    pn = torch.nn.functional.pad(normalize(prefix.to(device)).float(), (0, max_dim - prefix.shape[2]))
    weights, frozen = prefix_weights(rows, chunk)
    times = [1.0 + step * (-1.0 / num_steps) for step in range(num_steps)]
    return {"rtc": {"rtc_prefix": pn.contiguous(), "rtc_weights": weights[..., None].to(device),
                    "rtc_frozen": frozen[..., None].to(device)},
            "guidance": tuple(guidance_weights(times, rows.settings.max_guidance_weight))}


def hold_frozen(actions: torch.Tensor, rows: RtcRows) -> torch.Tensor:
    """``actions`` [B, H, A] with each row's frozen steps set to its prefix exactly (the
    sampler froze them in the normalised space; this drops the round trip's round-off)."""
    prefix = torch.as_tensor(np.asarray(rows.prefix, np.float32)).to(actions.device, actions.dtype)
    steps = torch.arange(actions.shape[1], device=actions.device)
    cut = torch.as_tensor(np.minimum(rows.delay, rows.pending), device=actions.device)
    return torch.where((steps[None] < cut[:, None])[..., None], prefix, actions)
