"""`python -m actor [hydra overrides]`: run an actor against a learner."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="../config", config_name="actor")
def main(cfg: DictConfig) -> None:
    from actor.app import Actor
    from actor.session import HandshakeError

    log = logging.getLogger("tandem.actor")
    try:
        actor = Actor(cfg)
        actor.run()
    except (ValueError, HandshakeError) as exc:
        log.error("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
