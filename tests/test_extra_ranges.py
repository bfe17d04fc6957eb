"""Integer policy extras have value ranges that ingest enforces (data/core/spec.py
``extra_ranges``, data/core/transitions.py ``validate``): an out-of-range action token or SDE step
from an actor is refused with a named error instead of reaching an update, which would index
with it and take the learner down."""

from __future__ import annotations

import numpy as np
import pytest

from data.core.spec import EnvSpec, config_hash
from data.core.transitions import TransitionBatch, TransitionError

ENV = EnvSpec(state_dim=2, action_dim=2)
SPEC = ENV.with_extras({"action_tokens": ("int64", (8,)), "log_prob": ("float32", ())},
                       {"action_tokens": (0, 255)})


def batch(tokens: np.ndarray) -> TransitionBatch:
    n = tokens.shape[0]
    recs = [{"observation.state": np.zeros(2, np.float32), "action": np.zeros(2, np.float32),
             "reward": 0.0, "terminated": False, "truncated": False, "intervened": False,
             "is_last": i == n - 1, "success": False, "policy_version": 0, "episode": 0, "step": i,
             "extra.action_tokens": tokens[i], "extra.log_prob": np.float32(-1.0), "task": ""}
            for i in range(n)]
    return TransitionBatch.from_records("a0", 0, recs)


def test_tokens_inside_the_range_pass_and_outside_are_named():
    ok = np.tile(np.array([0, 1, 2, 3, 250, 255, 7, 8]), (3, 1))
    batch(ok).validate(SPEC)
    for bad, shown in ((256, "0..256"), (-1, "-1..")):
        t = ok.copy()
        t[1, 4] = bad
        with pytest.raises(TransitionError, match=r"extra\.action_tokens: values must be in 0\.\.255") as e:
            batch(t).validate(SPEC)
        assert shown in str(e.value)
    batch(np.full((2, 8), 10**6)).validate(ENV.with_extras(dict(SPEC.extras)))  # no range: no check


def test_ranges_travel_in_the_welcome_spec_but_not_in_the_config_hash():
    back = EnvSpec.from_dict(SPEC.to_dict())
    assert back == SPEC and back.extra_ranges == {"action_tokens": (0, 255)}
    h = dict(env_name="e", policy_name="p", chunk=1)
    assert config_hash(SPEC, **h) == config_hash(ENV.with_extras(dict(SPEC.extras)), **h)


def test_a_range_must_name_an_extra_and_not_be_empty():
    # a float extra's range is a float range (float_ranges), an integer one's an extra range
    spec = ENV.with_extras(dict(SPEC.extras), {"log_prob": (-50, 5), "action_tokens": (0, 255)})
    assert spec.float_ranges["extra.log_prob"] == (-50.0, 5.0)
    assert spec.extra_ranges == {"action_tokens": (0, 255)}
    with pytest.raises(ValueError, match="not a float field"):
        ENV.with_extras(dict(SPEC.extras), {"missing": (0, 1)})
    with pytest.raises(ValueError, match="empty"):
        ENV.with_extras(dict(SPEC.extras), {"action_tokens": (5, 4)})
    with pytest.raises(ValueError, match="finite and not empty"):
        ENV.with_extras(dict(SPEC.extras), {"log_prob": (1, 0)})


def test_a_policy_without_integer_extras_declares_no_range():
    from agents.base import extras_ranges
    from agents.policies.mlp import MLPPolicy, MLPPolicyConfig

    # policies without integer extras declare none (OFT-discrete and PI0 flow_rl: tests/test_oft_rl.py,
    # tests/test_flow_rl.py)
    assert extras_ranges(MLPPolicy(MLPPolicyConfig(hidden_dims=(8,)), ENV)) == {}
