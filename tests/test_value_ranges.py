"""Every float field of a record that enters a loss has a declared value range in the spec,
checked at ingest with a named error (issue 24, class 2): finite but extreme rewards, actions,
states or float extras (float32's limits) are refused like out-of-range integer extras,
instead of overflowing a loss and turning the policy into NaN."""

from __future__ import annotations

import numpy as np
import pytest

from data.core.spec import DEFAULT_FLOAT_RANGE, EnvSpec, config_hash
from data.core.transitions import TransitionBatch, TransitionError

F32_MAX = float(np.finfo(np.float32).max)
ENV = EnvSpec(state_dim=2, action_dim=2)
SPEC = ENV.with_extras({"log_prob": ("float32", ()), "noise": ("float32", (3,))}, {"noise": (-10, 10)})


def batch(**over) -> TransitionBatch:
    n = 3
    recs = [{"observation.state": np.zeros(2, np.float32), "action": np.zeros(2, np.float32),
             "reward": 1.0, "terminated": False, "truncated": False, "intervened": False,
             "is_last": False, "success": False, "policy_version": 0, "episode": 0, "step": i,
             "extra.log_prob": np.float32(-1.0), "extra.noise": np.zeros(3, np.float32), "task": ""}
            for i in range(n)]
    for k, v in over.items():
        recs[1][k] = v
    return TransitionBatch.from_records("a0", 0, recs)


def test_every_float_field_has_a_range_and_extremes_are_named():
    assert set(SPEC.float_ranges) == {"reward", "action", "observation.state", "extra.log_prob",
                                      "extra.noise"}
    assert SPEC.float_ranges["reward"] == DEFAULT_FLOAT_RANGE and SPEC.float_ranges["extra.noise"] == (-10, 10)
    batch().validate(SPEC)
    for field, value in (("reward", F32_MAX), ("reward", -F32_MAX), ("action", np.array([0, F32_MAX], np.float32)),
                         ("observation.state", np.array([-3e38, 0], np.float32)),
                         ("extra.log_prob", np.float32(-3e38)), ("extra.noise", np.array([0, 11, 0], np.float32))):
        with pytest.raises(TransitionError, match=f"{field}: values must be in "):
            batch(**{field: value}).validate(SPEC)


def test_ranges_travel_in_the_welcome_spec_and_an_env_config_declares_its_own():
    from envs.registry import env_spec

    back = EnvSpec.from_dict(SPEC.to_dict())
    assert back == SPEC and back.float_ranges == SPEC.float_ranges
    h = dict(env_name="e", policy_name="p", chunk=1)
    assert config_hash(SPEC, **h) == config_hash(ENV.with_extras(dict(SPEC.extras)), **h)
    spec = env_spec({"name": "point_reach", "reward_range": [-2, 1], "state_range": [-5, 5]})
    assert spec.float_ranges["reward"] == (-2.0, 1.0) and spec.float_ranges["observation.state"] == (-5.0, 5.0)
    assert spec.float_ranges["action"] == DEFAULT_FLOAT_RANGE
    with pytest.raises(ValueError, match="finite and not empty"):
        EnvSpec(state_dim=1, action_dim=1, float_ranges={"reward": (0, float("inf"))})
