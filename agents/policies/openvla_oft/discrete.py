"""OpenVLA-OFT with the 256-bin action-token head: the policy on-policy RL trains
(network and checkpoint layout: :mod:`agents.policies.openvla_oft.policy`).

- ``act`` samples the K = chunk x A action tokens at ``temperature`` (the argmax when
  deterministic) and returns the chunk's log-probability and ``extras["action_tokens"]``
  [B, K], the classes 0..255 (they travel into the records as ``extra.action_tokens``).
- ``log_prob(obs, actions)`` scores a chunk; when ``obs`` carries ``extra.action_tokens`` (a
  training batch from the records) it scores exactly those tokens, otherwise it
  re-discretises ``actions`` (OpenVLA's bins; a sampled chunk's bin centres map back to the
  same classes).
- ``value(obs)``: VLA-RL's critic, a small MLP on the LM's hidden states at the action
  positions (mean over the K positions). With ``value_detach=True`` (default) the value loss
  trains that MLP only and leaves the adapters to the policy loss; ``value_head_dim=0``
  removes the head (GRPO needs none). The head is a trainable head: it is in
  ``trainable_state_dict`` (actors receive it and ignore it).
- ``reference()``: inside it the model computes with every LoRA adapter off, the KL
  reference of :class:`agents.ppo.agent.PPOAgent` without a second copy of the weights.
- ``bc_loss``: the cross-entropy of the demonstrated actions' tokens.

Capabilities: BCPolicy, LogProbPolicy, TokenLogProbPolicy (per action token), ReferencePolicy and
(with the head) ValuePolicy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agents.base import ActionChunk, Batch
from agents.policies import vla_common as vc
from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
from data.core.schema import EXTRA_PREFIX
from data.core.spec import EnvSpec

TOKENS = "action_tokens"


@dataclass
class OpenVLAOFTDiscretePolicyConfig(OpenVLAOFTPolicyConfig):
    action_head: str = "discrete"
    #: the value head's hidden width (0: no value head)
    value_head_dim: int = 256
    #: train the value head on detached hidden states (the adapters learn from the policy
    #: loss only); False lets the value loss shape the backbone's adapters as well
    value_detach: bool = True

    def validate(self) -> None:
        super().validate()
        if self.value_head_dim < 0:
            raise ValueError(f"value_head_dim must be >= 0, got {self.value_head_dim}")


class ValueHead(nn.Module):
    """[B, K, D] hidden states -> [B] values: mean over K, LayerNorm, MLP (float32)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h.float().mean(1))
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


class OpenVLAOFTDiscretePolicy(OpenVLAOFTPolicy):
    """OpenVLA-OFT with the 256-bin action-token head: sampling, log-probabilities, a value
    head and a LoRA-off reference (module docstring)."""

    head_kind = "discrete"

    def __init__(self, cfg: OpenVLAOFTDiscretePolicyConfig, spec: EnvSpec):
        super().__init__(cfg, spec)
        self.value_head = None
        if cfg.value_head_dim > 0:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(cfg.seed + 1)
                self.value_head = ValueHead(self.model.llm_dim, cfg.value_head_dim).to(self.device)
            self.value_head.requires_grad_(True)
        self._reference = vc.ReferenceSnapshot(self, self.lora, skip=("value_head.",))

    @torch.no_grad()
    def act(self, obs: Batch, *, deterministic: bool = False,
            generator: torch.Generator | None = None) -> ActionChunk:
        """Actions [B, chunk, A]; log_prob [B] of the returned chunk's tokens (the greedy ones
        when deterministic); ``extras["action_tokens"]`` [B, chunk*A] the classes (0..255),
        sampled with ``generator`` when given (else torch's global RNG)."""
        if (fast := self.fast_path()) is not None:
            return fast.act(obs, deterministic=deterministic, generator=generator)
        logits = self.action_logits(self.action_hidden(obs))
        if deterministic:
            cls = logits.argmax(-1)
        elif generator is None:
            cls = torch.distributions.Categorical(logits=logits).sample()
        else:  # what Categorical.sample draws, from the generator
            probs = logits.float().softmax(-1)
            cls = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, True,
                                    generator=generator).reshape(probs.shape[:-1])
        logp = logits.float().log_softmax(-1).gather(-1, cls[..., None]).squeeze(-1).sum(-1)
        a = self.class_values[cls].view(cls.shape[0], self.chunk_size, self.action_dim)
        return ActionChunk(self._finish(a), logp, {TOKENS: cls})

    def extras_spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"log_prob": ("float32", ()),
                TOKENS: ("int64", (self.chunk_size * self.action_dim,))}

    def extras_ranges(self) -> dict[str, tuple[int, int]]:
        """Ingest refuses action tokens outside the bins (an update would index with them)."""
        return {TOKENS: (0, int(self.pcfg.n_action_bins) - 1)}

    def _classes(self, obs: Batch, actions: torch.Tensor | None, tokens: torch.Tensor | None) -> torch.Tensor:
        if tokens is None:
            tokens = obs.get(EXTRA_PREFIX + TOKENS)
        if tokens is not None:
            cls = torch.as_tensor(tokens).to(self.device).long()
            k = self.chunk_size * self.action_dim
            if cls.ndim != 2 or cls.shape[1] != k:
                raise ValueError(f"{self.who}: {TOKENS} must be [B, {k}], got {list(cls.shape)}")
            if bool(((cls < 0) | (cls >= int(self.pcfg.n_action_bins))).any()):
                raise ValueError(f"{self.who}: {TOKENS} outside 0..{int(self.pcfg.n_action_bins) - 1}")
            return cls
        if actions is None:
            raise ValueError(f"{self.who}: log_prob needs actions or {TOKENS}")
        return self.action_classes(actions)

    def token_log_prob(self, obs: Batch, actions: torch.Tensor | None = None,
                       tokens: torch.Tensor | None = None) -> torch.Tensor:
        """log pi of each action token [B, chunk*A] (:meth:`log_prob` is their sum)."""
        cls = self._classes(obs, actions, tokens)
        logits = self.action_logits(self.action_hidden(obs))
        return logits.log_softmax(-1).gather(-1, cls[..., None]).squeeze(-1)

    def token_chunk_positions(self, num_tokens: int) -> torch.Tensor:
        """Each of :meth:`token_log_prob`'s tokens' action index in the chunk (action-major)."""
        if num_tokens % self.chunk_size:
            raise ValueError(f"{self.who}: {num_tokens} tokens do not split into {self.chunk_size} actions")
        return torch.arange(num_tokens) // (num_tokens // self.chunk_size)

    def log_prob(self, obs: Batch, actions: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
        """log pi(chunk | obs) [B] of env actions [B, chunk, A], or of the chunk's tokens
        (``tokens`` or ``obs["extra.action_tokens"]``, which win: they are what was sampled)."""
        return self.token_log_prob(obs, actions, tokens).sum(-1)

    def value(self, obs: Batch) -> torch.Tensor:
        """V(obs) [B] from the action positions' hidden states (module docstring)."""
        if self.value_head is None:
            raise ValueError(f"{self.who}: value_head_dim=0, this policy has no value head")
        h = self.action_hidden(obs)
        return self.value_head(h.detach() if self.cfg.value_detach else h)

    def value_parameters(self) -> list[nn.Parameter]:
        """The value head's parameters (PPO trains them at its value_lr); none without it."""
        return [] if self.value_head is None else list(self.value_head.parameters())

    def reference(self):
        """``with policy.reference():`` computes as the policy started: adapters and heads at
        their values at construction (LoRA B = 0: the base VLA) or at :meth:`mark_reference`."""
        return self._reference.swapped()

    def mark_reference(self) -> None:
        """The current adapters and heads become the reference (after an SFT start is loaded)."""
        self._reference.take()

    def bc_loss(self, batch: Batch) -> torch.Tensor:
        """Cross-entropy of the demonstrated actions' tokens (padded steps ignored)."""
        target, valid = self._targets(batch)
        cls = self.action_classes(target)
        logits = self.action_logits(self.action_hidden(batch))
        ce = F.cross_entropy(logits.transpose(1, 2), cls, reduction="none").view(cls.shape[0], self.chunk_size, -1)
        return (ce.mean(-1) * valid).sum() / valid.sum().clamp_min(1)
