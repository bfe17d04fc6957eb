"""Algorithm and policy registry: Hydra config -> objects, with pairing checks at start-up.

A policy entry names its class and config dataclass; an algorithm entry names its builder
class (:class:`agents.core.Builder`) and config dataclass. The learner app builds
everything through :func:`build_builder` and the builder's methods, with no
algorithm-specific branch.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

from agents.base import check_pair

# name -> (module, class, config dataclass)
POLICIES: dict[str, tuple[str, str, str]] = {
    "mlp": ("agents.policies.mlp", "MLPPolicy", "MLPPolicyConfig"),
    "pi0": ("agents.policies.pi0.policy", "Pi0Policy", "Pi0PolicyConfig"),
    "pi05": ("agents.policies.pi0.policy", "Pi05Policy", "Pi05PolicyConfig"),
    "openvla_oft": ("agents.policies.openvla_oft.policy", "OpenVLAOFTPolicy", "OpenVLAOFTPolicyConfig"),
    "openvla_oft_discrete": ("agents.policies.openvla_oft.discrete", "OpenVLAOFTDiscretePolicy",
                             "OpenVLAOFTDiscretePolicyConfig"),
}
# policy name -> (module, function): the function picks the class from the config section
CLASS_FOR_CONFIG: dict[str, tuple[str, str]] = {
    "pi0": ("agents.policies.pi0.flow_rl", "class_for_config"),
    "pi05": ("agents.policies.pi0.flow_rl", "class_for_config"),
}
# name -> (builder module, builder class, config module, config dataclass); a variant of an
# algorithm is a name of its own (its config a subclass of the algorithm's: ``sac_noise``)
ALGOS: dict[str, tuple[str, str, str, str]] = {
    "sac": ("agents.sac.builder", "SACBuilder", "agents.sac.agent", "SACConfig"),
    "sac_noise": ("agents.sac.noise_builder", "NoiseSACBuilder", "agents.sac.noise", "NoiseSACConfig"),
    "sac_residual": ("agents.sac.residual_builder", "ResidualSACBuilder",
                     "agents.sac.residual", "ResidualSACConfig"),
    "rejection_sampling": ("agents.rs.builder", "RejectionSamplingBuilder",
                           "agents.rs.agent", "RejectionSamplingConfig"),
    "ppo": ("agents.ppo.builder", "PPOBuilder", "agents.ppo.builder", "PPOBuilderConfig"),
    "grpo": ("agents.grpo.builder", "GRPOBuilder", "agents.grpo.config", "GRPOBuilderConfig"),
}


def _load(table: dict, kind: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    mod, cls, cfg = table[name]
    m = importlib.import_module(mod)
    return getattr(m, cls), getattr(m, cfg)


def make_config(cfg_cls, values: Mapping[str, Any], where: str):
    """Build a config dataclass, naming unknown keys and bad values."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(values, DictConfig):
            values = OmegaConf.to_container(values, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    values = {k: v for k, v in dict(values).items() if k != "name"}
    fields = {f.name: f for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; valid: {sorted(fields)}")
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)  # config dataclasses hold sequences as tuples
    try:
        obj = cfg_cls(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return obj


def policy_class(name: str, values: Mapping[str, Any] | None = None):
    """The class ``policy=name`` builds; a policy in :data:`CLASS_FOR_CONFIG` has a function
    ``(class, config section) -> class`` that picks a variant (PI0's ``flow_rl``)."""
    cls = _load(POLICIES, "policy", name)[0]
    if name not in CLASS_FOR_CONFIG:
        return cls
    mod, fn = CLASS_FOR_CONFIG[name]
    return getattr(importlib.import_module(mod), fn)(cls, values or {})


def build_builder(algo_cfg: Mapping[str, Any]):
    """The algorithm's builder from its config section (``name`` picks the algorithm)."""
    name = algo_cfg["name"]
    if name not in ALGOS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGOS)}")
    bmod, bcls, cmod, ccls = ALGOS[name]
    cfg = make_config(getattr(importlib.import_module(cmod), ccls), _plain(algo_cfg), f"algo={name}")
    return getattr(importlib.import_module(bmod), bcls)(cfg)


def check_algo_policy(algo_cfg: Mapping[str, Any] | str, policy: Mapping[str, Any] | str) -> None:
    """Fail at start-up, before any model is built, when the policy class lacks a
    capability the configured algorithm needs (``algo_cfg``: its config section, or just
    its name for the defaults; ``policy``: its config section or just its name)."""
    if isinstance(algo_cfg, str):
        algo_cfg = {"name": algo_cfg}
    values = _plain({"name": policy} if isinstance(policy, str) else policy)
    builder = build_builder(algo_cfg)
    cls = policy_class(values["name"], values)
    check_pair(algo_cfg["name"], builder.requires, values["name"], cls)
    builder.check_policy_class(values["name"], cls)  # a builder's check beyond capabilities


def _plain(values: Mapping[str, Any]) -> dict:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(values, DictConfig):
            return OmegaConf.to_container(values, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(values)


#: policy-section key of every policy: a safetensors file of its trainable state to start from
#: (``tools/sft.py`` writes one; None: the checkpoint's weights as they are)
INIT_TRAINABLE = "init_trainable"


def build_policy(policy_cfg: Mapping[str, Any], spec):
    name = policy_cfg["name"]
    cfg_cls = _load(POLICIES, "policy", name)[1]
    values = _plain(policy_cfg)
    init = values.pop(INIT_TRAINABLE, None)
    cls = policy_class(name, values)
    from agents.parallel import whole_weights

    with whole_weights():  # ZeRO-3: built whole, partitioned by accelerator.prepare
        policy = cls(make_config(cfg_cls, values, f"policy={name}"), spec)
    if init:
        load_init_trainable(policy, init, f"policy={name}")
        if hasattr(policy, "mark_reference"):  # a KL reference is the SFT start, not the model before it
            policy.mark_reference()
    return policy


def load_init_trainable(policy, path, where: str) -> None:
    """Load ``policy.init_trainable``: a safetensors file (never a pickle) of the trainable
    state ``policy.trainable_state_dict()`` has; a mismatch names what differs."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{where}: {INIT_TRAINABLE}={str(path)!r} is not a file")
    try:
        state = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the file is the user's: say which and why
        raise ValueError(f"{where}: {INIT_TRAINABLE}={str(path)!r} is not a safetensors file ({exc})") from exc
    try:
        policy.load_trainable_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{where}: {INIT_TRAINABLE}={str(path)!r} does not fit this policy: {exc}") from exc


def build_trained_policy(builder, policy_cfg: Mapping[str, Any], spec):
    """The policy an algorithm trains and serves: the configured policy, as the builder's
    ``wrap_policy`` makes it (noise-space SAC: PI0 + a noise actor; others: unchanged)."""
    return builder.wrap_policy(build_policy(policy_cfg, spec))
