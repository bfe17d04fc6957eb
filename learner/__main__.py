"""`python -m learner [hydra overrides]`: run the learner (train or eval)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="../config", config_name="learner")
def main(cfg: DictConfig) -> None:
    from learner.app import Learner

    try:
        learner = Learner(cfg)
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger("tandem.learner").error("%s", exc)
        sys.exit(2)
    learner.run()


if __name__ == "__main__":
    main()
