"""Algorithm and policy registry: Hydra config -> objects, with pairing checks at start-up."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

from agents.base import check_pair

# name -> (module, class, config dataclass)
POLICIES: dict[str, tuple[str, str, str]] = {
    "mlp": ("agents.policies.mlp", "MLPPolicy", "MLPPolicyConfig"),
    "pi0": ("agents.policies.pi0", "Pi0Policy", "Pi0PolicyConfig"),
    "pi05": ("agents.policies.pi0", "Pi05Policy", "Pi05PolicyConfig"),
    "openvla_oft": ("agents.policies.openvla_oft", "OpenVLAOFTPolicy", "OpenVLAOFTPolicyConfig"),
    "openvla_oft_discrete": ("agents.policies.openvla_oft", "OpenVLAOFTDiscretePolicy",
                             "OpenVLAOFTDiscretePolicyConfig"),
}
ALGOS: dict[str, tuple[str, str, str]] = {
    "sac": ("agents.sac", "SACAgent", "SACConfig"),
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


def policy_class(name: str):
    return _load(POLICIES, "policy", name)[0]


def algo_class(name: str):
    return _load(ALGOS, "algorithm", name)[0]


def check_algo_policy(algo_name: str, policy_name: str) -> None:
    algo_cls = algo_class(algo_name)
    pol_cls = policy_class(policy_name)
    check_pair(algo_name, frozenset(getattr(algo_cls, "requires", ())), policy_name,
               frozenset(getattr(pol_cls, "capabilities", ())))


def build_policy(policy_cfg: Mapping[str, Any], spec):
    name = policy_cfg["name"]
    cls, cfg_cls = _load(POLICIES, "policy", name)
    return cls(make_config(cfg_cls, policy_cfg, f"policy={name}"), spec)


def build_agent(algo_cfg: Mapping[str, Any], policy, spec, accelerator):
    name = algo_cfg["name"]
    cls, cfg_cls = _load(ALGOS, "algorithm", name)
    return cls(make_config(cfg_cls, algo_cfg, f"algo={name}"), policy, spec, accelerator)
