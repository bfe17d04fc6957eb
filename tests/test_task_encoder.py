"""The MLP's instruction encoder (``task_embed_dim`` > 0, :class:`agents.common.encoders.TaskEncoder`):
off by default; on, the features (and so the actions) depend on the instruction's words and on
nothing else of it, gradients reach the word embeddings, buckets are stable across processes,
and a batch without instructions is a clear error."""

from __future__ import annotations

import pytest
import torch

from agents.common.encoders import ObsEncoder, TaskEncoder, word_bucket
from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.spec import EnvSpec

SPEC = EnvSpec(state_dim=2, action_dim=2, cameras={"image": (16, 16, 3)}, has_task=True,
               max_episode_steps=10)
CFG = dict(hidden_dims=(16,), cnn_channels=(4,), image_embed_dim=8, state_embed_dim=8)


def _obs(tasks):
    g = torch.Generator().manual_seed(0)
    b = len(tasks)
    return {"observation.state": torch.rand(1, 2, generator=g).expand(b, 2).clone(),
            "observation.images.image": torch.randint(0, 255, (1, 16, 16, 3), generator=g,
                                                      dtype=torch.uint8).expand(b, 16, 16, 3).clone(),
            "task": list(tasks)}


def test_off_by_default_the_instruction_is_ignored():
    torch.manual_seed(0)
    enc = ObsEncoder(SPEC, MLPPolicyConfig(**CFG))
    assert enc.task is None
    f = enc(_obs(["reach the red target", "reach the green target"]))
    torch.testing.assert_close(f[0], f[1])


def test_on_the_actions_follow_the_instruction_words():
    torch.manual_seed(0)
    policy = MLPPolicy(MLPPolicyConfig(**CFG, task_embed_dim=6), SPEC)
    assert policy.encoder.out_dim == 8 + 8 + 6
    obs = _obs(["reach the red target", "reach the green target", "REACH the  red target"])
    a = policy.act(obs, deterministic=True).actions
    assert not torch.allclose(a[0], a[1])            # another colour word, another action
    torch.testing.assert_close(a[0], a[2])           # case and spacing do not matter
    # the BC loss trains the word embeddings
    loss = policy.bc_loss({**obs, "action": torch.zeros(3, 1, 2)})
    loss.backward()
    grad = policy.encoder.task.bag.weight.grad
    used = {word_bucket(w, 256) for w in "reach the red green target".split()}
    assert all(grad[i].abs().sum() > 0 for i in used)
    assert all(grad[i].abs().sum() == 0 for i in set(range(256)) - used)
    with pytest.raises(KeyError, match="reads the instruction"):
        policy.act({k: v for k, v in obs.items() if k != "task"})


def test_buckets_are_stable_and_empty_instructions_work():
    assert word_bucket("red", 256) == word_bucket("RED", 256)
    # blake2b, not Python's salted hash(): the same in every process (fixed expected values)
    assert [word_bucket(w, 1 << 30) for w in ("red", "green")] == [
        int.from_bytes(__import__("hashlib").blake2b(w.encode(), digest_size=8).digest(), "little") % (1 << 30)
        for w in ("red", "green")]
    enc = TaskEncoder(4, 16)
    out = enc(["", "reach"], torch.device("cpu"))
    assert out.shape == (2, 4) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="task_embed_dim and task_buckets"):
        TaskEncoder(0, 16)
