"""`python -m learner [hydra overrides]`: run the learner (train or eval)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="../config", config_name="learner")
def main(cfg: DictConfig) -> None:
    import os

    if int(os.environ.get("RANK", "0")) > 0:  # rank k of an N-rank learner (learner/distributed.py)
        from learner.distributed import Follower as make
    else:
        from learner.app import Learner as make
    try:
        process = make(cfg)
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger("tandem.learner").error("%s", exc)
        sys.exit(2)
    try:
        process.run()
    finally:  # an N-rank learner: close the process group before the interpreter tears down
        import torch.distributed as dist  # its threads (gloo aborted at exit without this)

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
