"""Local mode: the actor runs its own policy copy, refreshed from weight broadcasts.

Weights arrive on the learner's PUB socket (latest wins: the SUB queue is drained and only
the newest version is loaded). PUB is lossy, so when a pong reports a newer version than
the one loaded and no broadcast brought it, the weights are fetched over the request
channel instead. A slow actor (stalled, or on a thin link) finds a backlog of broadcasts
that are all older than what the learner has since reported (acks, pongs): it then skips
them all and fetches the newest over the request channel, rather than stepping through
stale versions. Versions only go up, except after a learner restart (its checkpoint's).

Every snapshot is verified before it is loaded (:func:`data.core.weights.from_wire`: its
digest, and exactly this policy's tensor names, shapes and dtypes): a truncated, corrupted
or partial one is refused whole and counted (:attr:`LocalPolicy.refused`), the loaded
weights stay as they were, and the next broadcast or fetch brings a whole one.

:meth:`LocalPolicy.act` returns what a remote act reply holds: actions [B, H, A], the
version and ``{"extra.<name>": [B, *shape]}`` of the policy's declared extras, checked the
same way the learner's inference thread checks them.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch
import zmq

from agents import registry
from data.core.codec import CodecError, Message, decode
from data.core.schema import TASK
from data.core.security import configure_client_socket
from data.core.weights import SnapshotError, digest_hex, from_wire
from data.core.transitions import extras_to_numpy

log = logging.getLogger("tandem.actor.local")


class LocalPolicy:
    def __init__(self, policy_cfg, spec, *, ctx: zmq.Context, host: str, pub_port: int,
                 security: dict | None = None):
        self.policy = registry.build_policy(policy_cfg, spec).eval()
        spec_fn = getattr(self.policy, "extras_spec", None)
        #: the policy's declared extras: name -> (dtype, per-chunk shape)
        self.extras_spec = dict(spec_fn()) if callable(spec_fn) else {}
        # what a snapshot must hold: exactly these names, shapes and dtypes
        self._expect = {k: SimpleNamespace(shape=tuple(v.shape), dtype=v.dtype)
                        for k, v in self.policy.trainable_state_dict().items()}
        self.version = -1
        self.digest = ""  # of the loaded snapshot
        self.loads = 0    # snapshots loaded
        self.refused = 0  # snapshots refused (digest or tensors wrong)
        self.learner_id: str | None = None
        self._ctx, self._endpoint, self._security = ctx, f"tcp://{host}:{pub_port}", security or {}
        self._max_frame = max([(1 << 20)] + [int(v.numel() * v.element_size()) + 4096
                                             for v in self.policy.trainable_state_dict().values()])
        self.sub: zmq.Socket | None = None
        self._subscribe()

    def _subscribe(self) -> None:
        """A new SUB connection: what the old one still held (or had yet to receive from a
        learner that is gone) is dropped with it."""
        if self.sub is not None:
            self.sub.close(0)
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 4)
        # no frame larger than this policy's largest tensor (or the header) is even buffered
        self.sub.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        configure_client_socket(self.sub, self._security)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self._endpoint)

    def load(self, msg: Message, *, skipped: int = 0, any_version: bool = False) -> bool:
        """Verify and load ``msg`` if it is newer than the loaded version (``any_version``:
        whatever its version; a restarted learner's); True if loaded. ``skipped``: queued
        broadcasts passed over for it (for the log)."""
        version, digest = msg["policy_version"], digest_hex(msg.arrays)
        if version <= self.version and not any_version:
            return False
        if any_version and version == self.version and digest == self.digest:
            return True  # these very weights are loaded already
        try:
            state = from_wire(msg.arrays, msg.get("bf16", []), expect=self._expect)
        except SnapshotError as exc:
            self.refused += 1
            log.error("refused weights version %d: %s (keeping version %d)", version, exc, self.version)
            return False
        self.policy.load_trainable_state_dict(state)
        self.version, self.digest = version, digest
        self.loads += 1
        log.info("loaded policy version %d (snapshot %s, %d tensors, skipped %d queued)", version,
                 digest[:12], len(state), skipped)
        return True

    def fetch(self, client, *, skipped: int = 0) -> bool:
        """The latest weights over the request channel; True if loaded."""
        msg = client.request_weights(self.version)
        return msg is not None and self.load(msg, skipped=skipped)

    def refresh(self, client) -> None:
        if client.learner_id != self.learner_id and client.connected:
            # a restarted learner may count versions from an older checkpoint: take its weights
            # whatever their version; until they load, the old ones (and their version) stay.
            # Broadcasts of the learner that is gone may still be queued or on their way, with
            # versions above the new learner's: a new subscription leaves them behind.
            if self.learner_id is not None:
                self._subscribe()
                self.learner_id = None
            msg = client.request_weights(-1)
            if msg is not None and self.load(msg, any_version=True):
                self.learner_id = client.learner_id
            return
        newest, queued = None, 0
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = decode(frames)
            except CodecError as exc:
                log.error("bad weights broadcast: %s", exc)
                continue
            if msg.type == "weights":
                newest, queued = msg, queued + 1
        # a backlog (more than one queued) older than what the learner reported since: stale
        stale = newest is not None and queued > 1 and client.policy_version > newest["policy_version"]
        if newest is not None and not stale:
            self.load(newest, skipped=queued - 1)
        elif (client.policy_version > self.version and client.connected
              and self.fetch(client, skipped=queued)):
            pass
        elif newest is not None:
            self.load(newest, skipped=queued - 1)

    @torch.no_grad()
    def act(self, arrays: dict[str, np.ndarray], tasks: list[str], deterministic: bool
            ) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
        obs = {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
        obs[TASK] = tasks
        chunk = self.policy.act(obs, deterministic=deterministic)
        actions = chunk.actions.float().numpy()
        try:
            extras = extras_to_numpy(chunk.extras_with_log_prob(), self.extras_spec, len(actions))
        except ValueError as exc:
            raise ValueError(f"local policy: {exc}") from None
        return actions, max(self.version, 0), extras

    def close(self) -> None:
        self.sub.close(0)
