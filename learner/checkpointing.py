"""What a learner run saves and restores: the algorithm's state, ingest's positions, the policy
version and the rank layout, in ``run_dir/checkpoints`` (the format: :mod:`learner.checkpoint`;
engines and ranks: :mod:`learner.engine_state`).

:meth:`Checkpointer.restore` picks the run's checkpoint (the same one on every rank), restores
it and publishes its weights (version 0, the untrained policy, without one);
:meth:`Checkpointer.save` writes one, never of weights that are not finite (the latest good
one stays; ``refused`` counts those).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from learner.checkpoint import checkpoint_age_s, format_age, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.console import Stages
from learner.engine_state import engines_of, ranks_meta, restore_algo, save_ranked
from learner.finite_guard import nonfinite

log = logging.getLogger("tandem.learner")


class Checkpointer:
    def __init__(self, *, root: Path, keep: int, resume: str, mode: str, algo: Any, ingest: Any,
                 weights: Any, ranks: Any, trainable: Callable[[], dict]):
        self.root, self.keep, self.resume, self.mode = root, keep, resume, mode
        self.algo, self.ingest, self.weights, self.ranks = algo, ingest, weights, ranks
        self.trainable = trainable  # the weights to publish (gathered from every rank under ZeRO-3)
        self.refused = 0  # checkpoints not written: their tensors held NaN or Inf

    def restore(self) -> None:
        path = latest_checkpoint(self.root) if self.resume != "never" else None
        self.ranks.share_text(str(path.resolve()) if path else "")  # every rank loads the same one
        if path is None:
            if self.resume == "must":
                raise FileNotFoundError(f"resume=must but {self.root} has no checkpoint")
            if self.mode == "eval":
                log.warning("evaluating an untrained policy: no checkpoint in %s", self.root)
            self.weights.publish(self.trainable(), version=0)
            return
        with Stages(f"checkpoint {path.name}", ["reading", "restoring", "publishing"]) as stage:
            state = load_checkpoint(path)
            if "algo" not in state:
                raise ValueError(f"{path} is a checkpoint of an older Tandem (no 'algo' state); "
                                 "start a new run_dir or pass resume=never")
            stage()
            restore_algo(self.algo, state, path, self.ranks.world, train=self.mode == "train")
            if self.mode == "train":
                self.ingest.load_state_dict(state["ingest"])
            stage()
            if self.weights.publish(self.trainable(), version=int(state["version"])) is None:
                raise ValueError(f"{path}: its policy weights hold NaN or Inf "
                                 f"({', '.join(self.weights.last_refused)}); resume from an earlier "
                                 "checkpoint (delete this one) or start a new run_dir")
        log.info("resumed from %s (written %s ago): %d updates, policy version %d", path,
                 format_age(checkpoint_age_s(path)), self.algo.updates, self.weights.version)

    def save(self, *, rank_died: bool = False) -> Path | None:
        """A checkpoint; with N ranks or DeepSpeed engines every rank writes its part
        (:mod:`learner.engine_state`), unless a rank died (``rank_died``). None when it could
        not be written."""
        engines, root, keep = engines_of(self.algo), self.root, self.keep

        def state() -> dict[str, Any]:
            return {"algo": self.algo.state_dict(), "ingest": self.ingest.state_dict(),
                    "version": self.weights.version, "ranks": ranks_meta(self.ranks.world, engines)}

        # never a checkpoint of weights that are not finite: the latest good one stays
        if self.ranks.world == 1 and not engines:
            st = state()  # the whole state is checked once (the policy's weights are in it)
            if self._refuse(nonfinite(st["algo"])):
                return None
            return save_checkpoint(root, self.algo.updates, st, keep=keep)
        if self._refuse(nonfinite(self.algo.policy.trainable_state_dict())):
            return None
        if rank_died:  # the other ranks are gone
            if engines:
                log.error("no final checkpoint: the DeepSpeed state is split over the ranks and a rank "
                          "died; the latest checkpoint stays %s", latest_checkpoint(root))
                return None
            return save_checkpoint(root, self.algo.updates, state(), keep=keep)  # DDP: rank 0's is whole
        return save_ranked(self.ranks, root, self.algo.updates, state, engines, keep=keep)

    def _refuse(self, bad: list[str]) -> bool:
        if not bad:
            return False
        self.refused += 1
        log.error("checkpoint not written: %d tensor(s) hold NaN or Inf (%s%s); the latest stays %s",
                  len(bad), ", ".join(bad[:5]), ", ..." if len(bad) > 5 else "", latest_checkpoint(self.root))
        return True
