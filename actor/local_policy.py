"""Local mode: the actor runs its own policy copy, refreshed from weight broadcasts.

Weights arrive on the learner's PUB socket (latest wins: the SUB queue is drained and only
the newest version is loaded). PUB is lossy, so when a pong reports a newer version than
the one loaded and no broadcast brought it, the weights are fetched over the request
channel instead.

:meth:`LocalPolicy.act` returns what a remote act reply holds: actions [B, H, A], the
version and ``{"extra.<name>": [B, *shape]}`` of the policy's declared extras, checked the
same way the learner's inference thread checks them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import zmq

from agents import registry
from data.core.codec import CodecError, Message, decode
from data.core.schema import TASK
from data.core.security import configure_client_socket
from data.core.weights import from_wire
from data.transitions import extras_to_numpy

log = logging.getLogger("tandem.actor.local")


class LocalPolicy:
    def __init__(self, policy_cfg, spec, *, ctx: zmq.Context, host: str, pub_port: int,
                 security: dict | None = None):
        self.policy = registry.build_policy(policy_cfg, spec).eval()
        spec_fn = getattr(self.policy, "extras_spec", None)
        #: the policy's declared extras: name -> (dtype, per-chunk shape)
        self.extras_spec = dict(spec_fn()) if callable(spec_fn) else {}
        self.version = -1
        self.learner_id: str | None = None
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 4)
        configure_client_socket(self.sub, security or {})
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{host}:{pub_port}")

    def load(self, msg: Message) -> None:
        version = msg["policy_version"]
        if version <= self.version:
            return
        self.policy.load_trainable_state_dict(from_wire(msg.arrays, msg.get("bf16", [])))
        self.version = version
        log.info("loaded policy version %d", version)

    def fetch(self, client) -> None:
        msg = client.request_weights(self.version)
        if msg is not None:
            self.load(msg)

    def refresh(self, client) -> None:
        if client.learner_id != self.learner_id and client.connected:
            # a restarted learner may count versions from an older checkpoint: take its weights
            self.learner_id = client.learner_id
            self.version = -1
            self.fetch(client)
            return
        newest = None
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                newest = decode(frames)
            except CodecError as exc:
                log.error("bad weights broadcast: %s", exc)
        if newest is not None and newest.type == "weights":
            self.load(newest)
        elif client.policy_version > self.version:
            self.fetch(client)

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
