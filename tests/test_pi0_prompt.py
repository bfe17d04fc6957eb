"""PI0 / PI0.5 prompts padded only to the batch's longest (agents/policies/pi0/prompt.py): the
actions and the training loss equal those of lerobot's full padding (48 / 200 tokens) on the
same noise, on lerobot's path and on the fast path; the columns are what the setting says."""

from __future__ import annotations

import pytest
import torch

from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
from agents.policies.pi0.prompt import padded_length
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_pi0

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (32, 32, 3), "wrist_image": (32, 32, 3)}, has_task=True)
CHUNK = 4
CLASSES = {"pi0": (Pi0Policy, Pi0PolicyConfig), "pi05": (Pi05Policy, Pi05PolicyConfig)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0prompt")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def obs(b=3):
    g = torch.Generator().manual_seed(0)
    tasks = ["pick up the black bowl between the plate and the ramekin and place it on the plate", "open it", "x"]
    o = {"observation.state": torch.randn(b, 8, generator=g), "task": (tasks * b)[:b]}
    for c in ("image", "wrist_image"):
        o[f"observation.images.{c}"] = torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g)
    return o


def make(ckpt, variant, **kw):
    cls, cfg_cls = CLASSES[variant]
    return cls(cfg_cls(checkpoint=str(ckpt), chunk_size=CHUNK, lora_rank=4, device="cpu", **kw), SPEC).eval()


def test_padded_length():
    assert padded_length(33, 200, 32) == 64 and padded_length(64, 200, 32) == 64
    assert padded_length(1, 200, 32) == 32 and padded_length(190, 200, 32) == 192 and padded_length(193, 200, 32) == 200
    assert padded_length(10, 48, 0) == 48 and padded_length(60, 48, 32) == 48


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_short_padding_changes_nothing_but_the_columns(ckpts, variant):
    torch.manual_seed(0)
    short = make(ckpts[variant], variant, prompt_pad_multiple=16)
    full = make(ckpts[variant], variant, prompt_pad_multiple=0)
    full.load_state_dict(short.state_dict())
    o = obs()
    lb_s, lb_f = short.lerobot_batch(o), full.lerobot_batch(o)
    ids_s = lb_s["observation.language.tokens"]
    ids_f, m_f = lb_f["observation.language.tokens"], lb_f["observation.language.attention_mask"]
    max_len = full.prompt_tokens.max_len
    assert ids_f.shape[1] == max_len == (48 if variant == "pi0" else 200)
    longest = int(m_f.sum(1).max())
    assert ids_s.shape[1] == padded_length(longest, max_len, 16) < max_len
    assert ids_s.shape[1] % 16 == 0 and ids_s.shape[1] >= longest
    assert torch.equal(ids_s, ids_f[:, :ids_s.shape[1]]) and not m_f[:, ids_s.shape[1]:].any()
    # full_prompt: lerobot's own padding whatever the setting
    assert short.lerobot_batch(o, full_prompt=True)["observation.language.tokens"].shape[1] == max_len

    noise = torch.randn(3, CHUNK, int(full.lr_cfg.max_action_dim), generator=torch.Generator().manual_seed(3))
    a_f = full.act(o, noise=noise).actions
    torch.testing.assert_close(short.act(o, noise=noise).actions, a_f, atol=1e-5, rtol=1e-5)
    short.cfg.fast_serving = "eager"  # the fast computation, eagerly (a CPU has no graphs)
    torch.testing.assert_close(short.act(o, noise=noise).actions, a_f, atol=1e-5, rtol=1e-5)
    assert short._fast is not None

    # training: the flow-matching loss on the same batch, noise and times
    short.train(), full.train()
    batch = dict(o, action=torch.rand(3, CHUNK, 7) * 2 - 1)
    losses = []
    for p in (short, full):
        torch.manual_seed(7)
        losses.append(p.bc_loss(batch))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)


def test_bad_setting_is_refused(ckpts):
    with pytest.raises(ValueError, match="prompt_pad_multiple"):
        Pi0PolicyConfig(checkpoint=str(ckpts["pi0"]), prompt_pad_multiple=-1).validate()
