"""The control words of an N-rank learner (:mod:`learner.distributed`): rank 0 broadcasts one
int64 pair per step, ``(CTRL_*, argument)``, and every rank acts on it. Its own module so that
the checkpoint side (:mod:`learner.engine_state`) and the training side share them without
importing each other."""

#: nothing to train on (a heartbeat), stop, an update follows, gather the weights (ZeRO-3
#: publish), write a checkpoint into the folder rank 0 names next, take rank 0's trainable
#: weights (a roll-back; argument 1: reset the optimizer too)
CTRL_IDLE, CTRL_STOP, CTRL_UPDATE, CTRL_GATHER, CTRL_SAVE, CTRL_SYNC = 0, 1, 2, 3, 4, 5
