"""What an actor and a learner must agree on about an environment, without gymnasium.

An :class:`EnvSpec` lists the observation layout of :mod:`data.core.schema`
(``observation.state`` [S], ``observation.images.<cam>`` [H, W, 3], optionally ``task``),
the action size A (a float Box in [-1, 1]^A) and the episode limit. ``extras`` is the
per-record policy extras the records carry (declared by the policy, see
:attr:`agents.base.Policy.extras_spec`): name -> (dtype, shape of one record's value).

The learner reads the spec from the env *config* (``envs.registry.env_spec``) without
building a simulator; an actor reads it off its env (``envs.spec.spec_from_env``) and the
two meet in the config hash.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace

from data.core.schema import EXTRA_PREFIX, OBS_IMAGE_PREFIX, OBS_STATE

#: dtypes a policy extra may have on the wire and in the dataset
EXTRA_DTYPES = ("float32", "int64", "int32", "bool")
#: the value range of a float record field that declares none: far inside float32 (and
#: bfloat16), so that sums over an episode, squares and products in a loss stay finite
DEFAULT_FLOAT_RANGE = (-1e6, 1e6)
#: the float record fields every spec has (besides its float extras, ``extra.<name>``)
FLOAT_FIELDS = ("reward", "action", OBS_STATE)
#: elements one record's extra may hold (size limit for untrusted input)
MAX_EXTRA_NUMEL = 1 << 16


@dataclass(frozen=True)
class EnvSpec:
    state_dim: int
    action_dim: int
    cameras: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    has_task: bool = False
    max_episode_steps: int = 0
    #: policy extras per record: name (without the ``extra.`` prefix) -> (dtype, shape)
    extras: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    #: inclusive value range of integer extras (OFT's action tokens 0..255, a flow chain's
    #: SDE step): ingest refuses a record outside it, so no update ever indexes with it
    extra_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: inclusive value range of every float field a record carries and a loss reads:
    #: ``reward``, ``action``, ``observation.state`` and each float extra (``extra.<name>``).
    #: Ingest refuses a record outside it (finite but extreme values overflow a loss: one
    #: episode of float32-limit rewards once turned the policy into NaN). Filled in on
    #: construction: a field not given takes :data:`DEFAULT_FLOAT_RANGE`.
    float_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state_dim < 0 or self.action_dim < 1:
            raise ValueError(f"spec: state_dim must be >= 0 and action_dim >= 1, got "
                             f"{self.state_dim}, {self.action_dim}")
        for cam, shape in self.cameras.items():
            if len(tuple(shape)) != 3 or tuple(shape)[2] != 3 or min(shape) < 1:
                raise ValueError(f"spec: camera {cam!r} must be [H, W, 3], got {shape}")
        for name, (dt, shape) in self.extras.items():
            if dt not in EXTRA_DTYPES:
                raise ValueError(f"spec: extra {name!r} has dtype {dt!r}; allowed {EXTRA_DTYPES}")
            n = 1
            for d in shape:
                n *= int(d)
            if n > MAX_EXTRA_NUMEL or any(int(d) < 1 for d in shape):
                raise ValueError(f"spec: extra {name!r} shape {shape} is empty or over "
                                 f"{MAX_EXTRA_NUMEL} elements")

        for name, rng in self.extra_ranges.items():
            if name not in self.extras or not self.extras[name][0].startswith(("int", "uint")):
                raise ValueError(f"spec: extra range for {name!r}, which is not an integer extra")
            lo, hi = rng
            if int(lo) > int(hi):
                raise ValueError(f"spec: extra {name!r} range {rng} is empty")
        floats = self.float_fields
        ranges = {}
        for name, rng in self.float_ranges.items():
            if name not in floats:
                raise ValueError(f"spec: value range for {name!r}, which is not a float field of "
                                 f"the records ({sorted(floats)})")
            lo, hi = float(rng[0]), float(rng[1])
            if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
                raise ValueError(f"spec: value range of {name!r} must be finite and not empty, "
                                 f"got {tuple(rng)}")
            ranges[name] = (lo, hi)
        for name in floats:
            ranges.setdefault(name, DEFAULT_FLOAT_RANGE)
        object.__setattr__(self, "float_ranges", dict(sorted(ranges.items())))

    @property
    def float_fields(self) -> list[str]:
        """Names of the float fields of a record: :data:`FLOAT_FIELDS` and the float extras."""
        return [*FLOAT_FIELDS, *(EXTRA_PREFIX + k for k, (dt, _) in sorted(self.extras.items())
                                 if dt.startswith("float"))]

    @property
    def image_keys(self) -> list[str]:
        return [OBS_IMAGE_PREFIX + c for c in sorted(self.cameras)]

    @property
    def extra_keys(self) -> list[str]:
        """Record array names of the extras (``extra.<name>``), sorted."""
        return [EXTRA_PREFIX + k for k in sorted(self.extras)]

    def with_extras(self, extras: dict[str, tuple[str, tuple[int, ...]]],
                    ranges: dict[str, tuple[float, float]] | None = None) -> "EnvSpec":
        """This spec with the policy's extras; ``ranges`` (the policy's ``extras_ranges()``)
        bound integer extras (:attr:`extra_ranges`) and float ones (:attr:`float_ranges`)."""
        extras = {k: (str(dt), tuple(int(d) for d in s)) for k, (dt, s) in extras.items()}
        ranges = ranges or {}
        ints = {k: (int(lo), int(hi)) for k, (lo, hi) in ranges.items()
                if k in extras and not extras[k][0].startswith("float")}
        floats = {k: v for k, v in self.float_ranges.items() if not k.startswith(EXTRA_PREFIX)}
        floats.update({EXTRA_PREFIX + k: (float(lo), float(hi)) for k, (lo, hi) in ranges.items()
                       if k not in ints})
        return replace(self, extras=extras, extra_ranges=ints, float_ranges=floats)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cameras"] = {k: list(v) for k, v in sorted(self.cameras.items())}
        d["extras"] = {k: [dt, list(s)] for k, (dt, s) in sorted(self.extras.items())}
        d["extra_ranges"] = {k: [lo, hi] for k, (lo, hi) in sorted(self.extra_ranges.items())}
        d["float_ranges"] = {k: [lo, hi] for k, (lo, hi) in sorted(self.float_ranges.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EnvSpec":
        """Inverse of :meth:`to_dict` (config files, the welcome message)."""
        try:
            return cls(
                state_dim=int(d["state_dim"]), action_dim=int(d["action_dim"]),
                cameras={str(k): tuple(int(x) for x in v) for k, v in dict(d.get("cameras") or {}).items()},
                has_task=bool(d.get("has_task", False)),
                max_episode_steps=int(d.get("max_episode_steps") or 0),
                extras={str(k): (str(v[0]), tuple(int(x) for x in v[1]))
                        for k, v in dict(d.get("extras") or {}).items()},
                extra_ranges={str(k): (int(v[0]), int(v[1]))
                              for k, v in dict(d.get("extra_ranges") or {}).items()},
                float_ranges={str(k): (float(v[0]), float(v[1]))
                              for k, v in dict(d.get("float_ranges") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"bad env spec {d!r}: {exc}") from exc


def config_hash(spec: EnvSpec, *, env_name: str, policy_name: str, chunk: int) -> str:
    """Short hash of everything an actor and the learner must agree on (the env layout, the
    policy and its chunk size; the policy's extras are the learner's to declare)."""
    d = spec.to_dict()
    d.pop("extras")
    d.pop("extra_ranges")
    d.pop("float_ranges")  # the learner's to declare (its env config and policy), as the extras
    blob = json.dumps({"env": env_name, "spec": d, "policy": policy_name, "chunk": int(chunk)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
