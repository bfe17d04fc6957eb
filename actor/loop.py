"""The actor's control loop: env steps, action chunks, transition records, progress.

Per step it records obs_t, the action executed (the human's while intervening), reward,
terminated and truncated (separately), intervened, success, the policy version that
produced the action, the episode id and step index. After an episode's last step it
records the final observation (``is_last``). Records are batched into the spool and
streamed by :class:`actor.client.LearnerClient`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import gymnasium as gym
import numpy as np

from actor.client import LearnerClient
from data.core.schema import OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.transitions import TransitionBatch

log = logging.getLogger("tandem.actor")

ActFn = Callable[[dict[str, np.ndarray], list[str], bool], tuple[np.ndarray, int]]


def obs_arrays(obs: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """Env observation -> (arrays with a batch dim of 1, [task])."""
    arrays = {OBS_STATE: np.asarray(obs[OBS_STATE], dtype=np.float32)[None]}
    for k, v in obs.items():
        if k.startswith(OBS_IMAGE_PREFIX):
            arrays[k] = np.ascontiguousarray(v, dtype=np.uint8)[None]
    return arrays, [str(obs.get(TASK, ""))]


class ActorLoop:
    def __init__(
        self,
        env: gym.Env,
        client: LearnerClient,
        act_fn: ActFn,
        *,
        actor_id: str,
        batch_size: int = 32,
        execute: int = 0,
        deterministic: bool = False,
        seed: int = 0,
        log_every_s: float = 5.0,
        on_poll: Callable[[], None] | None = None,
    ):
        self.env = env
        self.client = client
        self.act_fn = act_fn
        self.actor_id = actor_id
        self.batch_size = batch_size
        self.execute = execute
        self.deterministic = deterministic
        self.seed = seed
        self.log_every_s = log_every_s
        self.on_poll = on_poll
        self.records: list[dict] = []
        self.steps = 0
        self.episodes = 0
        self.returns: deque = deque(maxlen=20)
        self.successes: deque = deque(maxlen=20)

    def _record(self, obs: dict, **step) -> None:
        rec = {k: np.asarray(v, np.uint8) for k, v in obs.items() if k.startswith(OBS_IMAGE_PREFIX)}
        rec[OBS_STATE] = np.asarray(obs[OBS_STATE], np.float32)
        rec[TASK] = str(obs.get(TASK, ""))
        rec.update(step)
        self.records.append(rec)

    def _flush(self, force: bool = False) -> None:
        if self.records and (force or len(self.records) >= self.batch_size):
            spool = self.client.spool
            while spool.full:
                log.warning("spool full (%.0f MB unacknowledged): waiting for the learner",
                            spool.nbytes / 2**20)
                self.client.poll(0.5)
            spool.append(TransitionBatch.from_records(self.actor_id, spool.next_seq, self.records))
            self.records = []
        self.client.poll(0.0)
        if self.on_poll:
            self.on_poll()

    def _new_episode(self) -> int:
        """Reserve an episode id in the spool's meta, so a restarted actor never reuses it."""
        spool = self.client.spool
        episode = spool.next_episode
        spool.set_next_episode(episode + 1)
        return episode

    def run(self, *, max_episodes: int = 0, stop: Callable[[], bool] = lambda: False) -> None:
        spool = self.client.spool
        last_log, last_steps = time.monotonic(), 0
        episode = self._new_episode()
        obs, info = self.env.reset(seed=self.seed + episode)
        step, ret, success, chunk, ci = 0, 0.0, False, None, 0
        version = 0
        while not stop() and not (max_episodes and self.episodes >= max_episodes):
            if chunk is None or ci >= len(chunk):
                arrays, tasks = obs_arrays(obs)
                actions, version = self.act_fn(arrays, tasks, self.deterministic)
                chunk = actions[0]
                if self.execute:
                    chunk = chunk[: self.execute]
                ci = 0
            action = np.asarray(chunk[ci], dtype=np.float32)
            ci += 1
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            intervened = bool(info.get("intervened", False))
            executed = np.asarray(info["human_action"], np.float32) if intervened else action
            success = bool(info.get("is_success", False))  # the episode's outcome is its last step's
            self._record(
                obs, action=executed, reward=np.float32(reward), terminated=bool(terminated),
                truncated=bool(truncated), intervened=intervened, is_last=False,
                success=bool(info.get("is_success", False)), policy_version=version,
                episode=episode, step=step,
            )
            self.steps += 1
            ret += float(reward)
            step += 1
            obs = next_obs
            if intervened:
                chunk = None  # ask the policy again once the human lets go
            if terminated or truncated:
                self._record(
                    obs, action=np.zeros_like(action), reward=np.float32(0.0), terminated=False,
                    truncated=False, intervened=False, is_last=True, success=success,
                    policy_version=version, episode=episode, step=step,
                )
                self._flush(force=True)
                self.episodes += 1
                self.returns.append(ret)
                self.successes.append(float(success))
                episode = self._new_episode()
                obs, info = self.env.reset(seed=self.seed + episode)
                step, ret, success, chunk = 0, 0.0, False, None
            else:
                self._flush()
            now = time.monotonic()
            if now - last_log >= self.log_every_s:
                rate = (self.steps - last_steps) / (now - last_log)
                log.info(
                    "steps %d | %.0f steps/s | episodes %d | return %.2f | success %.2f | version %d"
                    " | unacked %d | act %.1f ms", self.steps, rate, self.episodes,
                    np.mean(self.returns) if self.returns else float("nan"),
                    np.mean(self.successes) if self.successes else float("nan"),
                    version, len(spool), self.client.last_act_ms,
                )
                last_log, last_steps = now, self.steps
        self._flush(force=True)
