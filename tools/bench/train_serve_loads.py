"""The actor loads of :mod:`tools.bench.train_serve`: seconds between one actor's requests, or
``sim`` (closed-loop simulated actors, each stepping its own env between requests)."""

from __future__ import annotations

#: the ``--period`` load of closed-loop simulated actors
SIM = "sim"


def load_key(period: float | str) -> str:
    """A load's name in ``by_period``: ``"0.5"``, ``"0"`` or ``"sim"``."""
    return SIM if period == SIM else f"{period:g}"


def parse_loads(text: str) -> list[float | str]:
    """``--period``'s comma-separated loads: seconds between requests, or ``sim``."""
    loads: list[float | str] = []
    for p in (x.strip() for x in str(text).split(",")):
        if not p:
            continue
        if p == SIM:
            loads.append(SIM)
            continue
        try:
            loads.append(float(p))
        except ValueError:
            raise SystemExit(f"--period: {p!r} is neither seconds between requests nor {SIM!r}") from None
    return loads


def execute_for(name: str, policy, execute: int) -> int:
    """Actions of each chunk a simulated actor runs: ``execute`` if given, else PI0's 5 of its
    50 (openpi's LIBERO replanning) and the whole chunk for the others (OpenVLA-OFT's 8)."""
    if execute:
        return int(execute)
    return min(5, int(policy.chunk_size)) if name.startswith("pi0") else 0


def env_config(args) -> dict | None:
    """The simulated actors' env config: ``--env`` with ``image_size`` (``--image-size``) and every
    ``--env-set key=value`` (YAML values)."""
    if not args.env:
        return None
    return {"name": args.env, "image_size": args.image_size, **key_values(args.env_set, "--env-set")}


def key_values(items: list[str], flag: str) -> dict:
    """``key=value`` entries (YAML values) as a dict; ``flag`` names them in errors."""
    import yaml

    out: dict = {}
    for kv in items:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            raise SystemExit(f"{flag} {kv!r}: expected key=value")
        out[key] = yaml.safe_load(value)
    return out
