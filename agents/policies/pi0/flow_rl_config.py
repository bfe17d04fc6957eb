"""The flow-RL keys of :class:`agents.policies.pi0.policy.Pi0PolicyConfig` and their check, apart from
:mod:`agents.policies.pi0.flow_rl` (which builds on PI0) so that PI0's config checks them without
importing it."""

from __future__ import annotations

FLOW_RL_MODES = ("noise", "sde")
VALUE_FEATURES = ("expert", "prefix")


def validate_flow_config(cfg) -> None:
    """Check the flow-RL fields of a :class:`agents.policies.pi0.policy.Pi0PolicyConfig`."""
    who = f"policy={cfg.variant}"
    if cfg.flow_rl not in FLOW_RL_MODES:
        raise ValueError(f"{who}: flow_rl must be null (plain PI0), 'noise' (Flow-Noise) or 'sde' "
                         f"(Flow-SDE), got {cfg.flow_rl!r}")
    if not 0 < cfg.noise_std_min < cfg.noise_std_max:
        raise ValueError(f"{who}: need 0 < noise_std_min < noise_std_max, got {cfg.noise_std_min}, "
                         f"{cfg.noise_std_max}")
    if not 0.0 <= cfg.init_noise_scale <= 1.0:
        raise ValueError(f"{who}: init_noise_scale must be in [0, 1], got {cfg.init_noise_scale}")
    if cfg.sde_noise_level <= 0:
        raise ValueError(f"{who}: sde_noise_level must be > 0, got {cfg.sde_noise_level}")
    if cfg.value_features not in VALUE_FEATURES:
        raise ValueError(f"{who}: value_features must be one of {VALUE_FEATURES}, got {cfg.value_features!r}")
    if min(cfg.noise_head_hidden, cfg.value_hidden) < 1:
        raise ValueError(f"{who}: noise_head_hidden and value_hidden must be >= 1")
