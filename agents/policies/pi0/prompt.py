"""PI0 / PI0.5 prompts: the text lerobot's processors build, and its tokens.

- PI0: the task followed by a newline;
- PI0.5: openpi's prompt, ``Task: <task>, State: <the state discretised into 256 bins>;\\nAction: ``.

Tokens are right-padded, as lerobot pads them, but only up to the batch's longest prompt
rounded up to ``multiple`` (at most ``max_len``), not always to ``max_len`` (lerobot's 48 for
PI0, 200 for PI0.5). Padded tokens are masked out as keys everywhere and take no position
from the real ones, so the model's output does not depend on how far a prompt is padded; the
shorter prefix is what it saves (a PI0.5 prompt of ~60 tokens in a 200-token pad made the
prefix 712 tokens instead of ~576). ``multiple`` 0 pads to ``max_len`` always. Prompts longer
than ``max_len`` are truncated to it, as lerobot does.
"""

from __future__ import annotations

import numpy as np
import torch

#: prompts tokenised and kept on the device at most (a cache of the recent ones)
CACHE_SIZE = 4096


def prompts(variant: str, tasks: list[str], state: torch.Tensor) -> list[str]:
    """The prompt text of each row: ``state`` [B, S] normalised (PI0.5 discretises it)."""
    if variant != "pi05":
        return [t if t.endswith("\n") else t + "\n" for t in tasks]
    disc = np.digitize(state.clamp(-1, 1).cpu().numpy(), bins=np.linspace(-1, 1, 257)[:-1]) - 1
    return [f"Task: {t.strip().replace('_', ' ').replace(chr(10), ' ')}, State: "
            f"{' '.join(map(str, d))};\nAction: " for t, d in zip(tasks, disc)]


def padded_length(longest: int, max_len: int, multiple: int) -> int:
    """Columns a batch whose longest prompt has ``longest`` tokens is padded to."""
    if multiple <= 0:
        return max_len
    return min(max_len, max(multiple, -(-longest // multiple) * multiple))


class PromptTokens:
    """``(prompts, device) -> (ids [B, L] long, mask [B, L] bool)``, each prompt tokenised once
    (its ``max_len`` row kept on the device with its length)."""

    def __init__(self, tokenizer, max_len: int, multiple: int):
        if multiple < 0:
            raise ValueError(f"policy.prompt_pad_multiple must be >= 0, got {multiple}")
        self.tokenizer, self.max_len, self.multiple = tokenizer, int(max_len), int(multiple)
        self._cache: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def __call__(self, texts: list[str], device: torch.device, *, full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``full``: pad to ``max_len`` whatever ``multiple`` says (lerobot's own padding)."""
        dev = str(device)  # a policy moved to another device tokenises anew
        todo = [p for p in dict.fromkeys(texts) if (p, dev) not in self._cache]
        if todo:
            enc = self.tokenizer(todo, max_length=self.max_len, truncation=True, padding="max_length",
                                 padding_side="right", return_tensors="pt")
            if len(self._cache) + len(todo) > CACHE_SIZE:
                self._cache.clear()
            for i, p in enumerate(todo):
                m = enc["attention_mask"][i]
                self._cache[(p, dev)] = (enc["input_ids"][i].to(device), m.to(device, torch.bool), int(m.sum()))
        rows = [self._cache[(p, dev)] for p in texts]
        cols = self.max_len if full else padded_length(max(r[2] for r in rows), self.max_len, self.multiple)
        return torch.stack([r[0][:cols] for r in rows]), torch.stack([r[1][:cols] for r in rows])
