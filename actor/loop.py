"""The actor's control loop: env steps, action chunks, transition records, progress.

Per step it records obs_t, the action executed (the human's while intervening), reward,
terminated and truncated (separately), intervened, success, the policy version that
produced the action, the episode id and step index. After an episode's last step it
records the final observation (``is_last``). Records are batched into the spool and
streamed by :class:`actor.client.LearnerClient`.

Chunks, extras and jobs (columns of :mod:`data.core.schema`):

- ``chunk_start`` is True on the step whose observation the policy was just asked about
  and whose executed action is the first of that chunk; ``chunk_index`` is the step's
  position in the chunk being executed (0, 1, ...).
- ``extra.<name>``: every step carries the extras of the chunk it belongs to (the same
  value on each step of a chunk). The layout (names, dtypes, shapes) is the one the
  learner declared in its welcome (``client.spec.extras``); a policy that misses a declared
  extra is an error, one the learner did not declare is dropped (logged once).
- A step driven by the human (``intervened``): ``chunk_start`` is False (its action is not
  the policy's), ``chunk_index`` is its position in the policy chunk it interrupted, and it
  carries that interrupted chunk's extras and version. After the human lets go the policy
  is asked again, so the next policy step starts a new chunk.
- The ``is_last`` record (final observation, no action, no policy query): ``chunk_start``
  False, ``chunk_index`` 0, every extra zeros of its declared dtype and shape.
- No action (:class:`actor.client.ActError`: the learner could not serve the request, or did
  not answer): the actor never exits for it. The env takes its safe behaviour once per outage
  (:func:`policy_outage`), the loop backs off (0.1 s doubling to 5 s) keeping the link alive and
  asks again; ``holding``, ``act_failures`` and ``outages`` say so in its status. An env that
  stopped (a robot) or an observation the learner refused starts a new episode.
- Real-time chunking (``rtc``, :mod:`actor.rtc`): the next chunk is asked for while the current
  one runs and takes over when its reply arrives, ``k`` steps after the observation it was asked
  about; that step has ``chunk_start`` True and ``chunk_index`` ``k`` (the delay), the steps before
  it carry the previous chunk's index, extras and version. ``control_hz`` paces the env steps.
- ``group_id``: the group of the learner's job for the episode, -1 without one. When the
  welcome said ``jobs``, the loop asks ``get_job(episode)`` before each reset and runs the
  job exactly: ``env.reset(seed=job.seed, options=job.reset_options())`` and deterministic
  actions if ``job.deterministic``. Without a job it resets with ``seed + episode`` and no
  options, as before.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from typing import Callable

import gymnasium as gym
import numpy as np

from actor.client import ActError, LearnerClient
from actor.rtc import RtcChunker
from data.core.jobs import NO_GROUP, Job
from data.core.schema import EXTRA_PREFIX, OBS_IMAGE_PREFIX, OBS_STATE, TASK
from data.core.transitions import TransitionBatch

log = logging.getLogger("tandem.actor")

#: (obs arrays [1, ...], [task], deterministic) -> (actions [1, H, A], policy version,
#: {"extra.<name>": [1, *shape]})
ActFn = Callable[[dict[str, np.ndarray], list[str], bool],
                 tuple[np.ndarray, int, dict[str, np.ndarray]]]
#: episode id -> the learner's job for it, or None
JobFn = Callable[[int], "Job | None"]
#: after each env step: (obs the action was chosen on, executed action, reward, intervened,
#: policy version, episode id, step index)
StepFn = Callable[[dict, np.ndarray, float, bool, int, int, int], None]


def policy_outage(env: gym.Env, reason: str) -> bool:
    """The env's safe behaviour while the policy gives no action: the first ``on_policy_outage
    (reason)`` along the wrapper stack (a robot env stops the arm and returns True: the episode
    cannot go on); an env without one is held, as a simulator is by not stepping it (False)."""
    e = env
    while e is not None:
        hook = getattr(e, "on_policy_outage", None)
        if callable(hook):
            try:
                return bool(hook(reason))
            except Exception:  # a failing hook must not end the actor: log, treat as stopped
                log.exception("the env's on_policy_outage failed")
                return True
        e = getattr(e, "env", None)
    return False


def obs_arrays(obs: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """Env observation -> (arrays with a batch dim of 1, [task])."""
    arrays = {OBS_STATE: np.asarray(obs[OBS_STATE], dtype=np.float32)[None]}
    for k, v in obs.items():
        if k.startswith(OBS_IMAGE_PREFIX):
            arrays[k] = np.ascontiguousarray(v, dtype=np.uint8)[None]
    return arrays, [str(obs.get(TASK, ""))]


def actor_seed(seed: int | None, actor_id: str) -> int:
    """The first episode's reset seed of an actor (episode ``e`` resets with this + ``e``).

    ``seed`` given: that seed, as configured. ``None`` (the config's default): one derived from
    ``actor_id`` (CRC-32, below 2**31), so that actors started with the same config do not
    replay the same start states in step (every actor's episode counter starts at 0).
    """
    if seed is not None:
        return int(seed)
    return zlib.crc32(str(actor_id).encode()) & 0x7FFFFFFF


def _run_percentiles(client) -> tuple[str, str]:
    """The run's act round-trip p50 and p99 for the log line ("-" before the first act)."""
    hist = getattr(client, "act_hist", None)
    if hist is None or not hist.n:
        return "-", "-"
    return f"{hist.quantile(0.5):.1f}", f"{hist.quantile(0.99):.1f}"


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
        get_job: JobFn | None = None,
        on_step: StepFn | None = None,
        rtc: RtcChunker | None = None,
        control_hz: float = 0.0,
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
        self.get_job = get_job
        self.jobs_run = 0
        self._warned_undeclared: set[str] = set()
        self.records: list[dict] = []
        self.steps = 0
        self.episodes = 0
        self.returns: deque = deque(maxlen=20)
        self.successes: deque = deque(maxlen=20)
        self.on_step = on_step
        #: real-time chunking (actor/rtc.py): the next chunk is asked for while this one runs
        self.rtc = rtc
        #: env steps paced to this rate (0: as fast as the env and the policy go), as on a robot
        self.period_s = 1.0 / control_hz if control_hz > 0 else 0.0
        self._tick = 0.0
        # the episode in progress, for the operator's view (actor/console.py)
        self.episode = -1
        self.episode_step = 0
        self.episode_return = 0.0
        self.in_control = "policy"   # policy | human: who drove the last step
        self.version = 0             # policy version of the action last executed
        self.interventions = 0       # steps driven by the human, all episodes
        # no action from the policy (ActError): the env is held safe and the request retried
        self.holding: str | None = None  # why, while it lasts ("code: message")
        self.act_failures = 0        # failed act requests, all outages
        self.outages = 0             # outages (runs of failed requests)
        self.backoff_s = (0.1, 5.0)  # first and longest wait between retries
        self._streak = 0

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

    def _declared_extras(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        spec = getattr(self.client, "spec", None)
        return dict(spec.extras) if spec is not None else {}

    def _zero_extras(self) -> dict[str, np.ndarray]:
        return {EXTRA_PREFIX + k: np.zeros(shape, dt) for k, (dt, shape) in self._declared_extras().items()}

    def _chunk_extras(self, extras: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Row 0 of the act reply's extras, exactly as the learner declared them."""
        out = {}
        for name, (dt, shape) in self._declared_extras().items():
            a = extras.get(EXTRA_PREFIX + name)
            if a is None:
                raise ValueError(f"the learner declares policy extra {name!r} but the policy "
                                 f"returned only {sorted(extras)}")
            row = np.asarray(a[0], dtype=dt)
            if row.shape != tuple(shape):
                raise ValueError(f"policy extra {name!r}: shape {row.shape}, the learner "
                                 f"declared {tuple(shape)}")
            out[EXTRA_PREFIX + name] = row
        for k in set(extras) - set(out) - self._warned_undeclared:
            log.warning("dropping policy extra %r: the learner does not declare it", k)
            self._warned_undeclared.add(k)
        return out

    def _hold(self, exc: ActError, stop: Callable[[], bool]) -> bool:
        """No action for the current observation: on the first failure of an outage the env
        takes its safe behaviour (:func:`policy_outage`: a robot stops, a simulator simply
        waits: nothing steps), then the loop waits, backing off, while the client keeps its
        link (heartbeats, acks, a new handshake), and the caller asks again. Returns True
        when this episode cannot go on (the env stopped, or the learner refused this
        observation itself): the caller starts a new one; the unfinished one is never stored."""
        self.act_failures += 1
        self.holding = f"{exc.code}: {exc.message}"
        stopped = False
        if self._streak == 0:
            self.outages += 1
            stopped = policy_outage(self.env, self.holding)
            log.warning("no action from the policy (%s): %s, retrying with backoff", self.holding,
                        "the env stopped (a new episode follows)" if stopped else "holding the env")
        delay = min(self.backoff_s[1], self.backoff_s[0] * 2 ** min(self._streak, 16))
        self._streak += 1
        deadline = time.monotonic() + delay
        while not stop() and (left := deadline - time.monotonic()) > 0:
            self.client.poll(min(0.1, left))
            if self.on_poll:
                self.on_poll()
        return stopped or exc.code == "bad_observation"

    def _pace(self) -> None:
        """With ``control_hz``: wait for this step's tick (a late step moves the ticks on)."""
        if self.period_s:
            now = time.monotonic()
            wait = self._tick + self.period_s - now
            if wait > 0:
                time.sleep(wait)
            self._tick = max(now, self._tick + self.period_s)

    def _resume(self) -> None:
        if self._streak:
            log.info("the policy answers again after %d failed request(s) (%s)", self._streak,
                     self.holding)
        self.holding, self._streak = None, 0

    def _start_episode(self) -> tuple[int, Job | None, dict]:
        """Reserve the next episode id, ask the learner for its job, reset the env."""
        episode = self._new_episode()
        job = self.get_job(episode) if self.get_job is not None else None
        if job is None:
            obs, _ = self.env.reset(seed=self.seed + episode)
        else:
            obs, _ = self.env.reset(seed=job.seed, options=job.reset_options())
            self.jobs_run += 1
            log.debug("episode %d runs job %s", episode, job)
        self.episode, self.episode_step, self.episode_return = episode, 0, 0.0
        return episode, job, obs

    def run(self, *, max_episodes: int = 0, stop: Callable[[], bool] = lambda: False) -> None:
        spool = self.client.spool
        last_log, last_steps = time.monotonic(), 0
        episode, job, obs = self._start_episode()
        step, ret, success, chunk, ci = 0, 0.0, False, None, 0
        version, extras = 0, {}
        while not stop() and not (max_episodes and self.episodes >= max_episodes):
            group = job.group_id if job is not None else NO_GROUP
            if self.rtc is not None:
                arrays, tasks = obs_arrays(obs)
                deterministic = self.deterministic or (job is not None and job.deterministic)
                try:
                    st = self.rtc.next(arrays, tasks, deterministic)
                except ActError as exc:
                    if exc.code == "bad_request":  # the learner refuses RTC itself: a config error
                        raise RuntimeError(f"chunk.rtc=true: {exc.message}") from exc
                    if self._hold(exc, stop):
                        self._flush(force=True)
                        episode, job, obs = self._start_episode()
                        step, ret, success = 0, 0.0, False
                        self.rtc.reset()
                    continue
                self._resume()
                if st.start:
                    version, extras = st.version, self._chunk_extras(st.extras)
                action, index, first = np.asarray(st.action, dtype=np.float32), st.index, st.start
            else:
                if chunk is None or ci >= len(chunk):
                    arrays, tasks = obs_arrays(obs)
                    deterministic = self.deterministic or (job is not None and job.deterministic)
                    try:
                        actions, version, reply_extras = self.act_fn(arrays, tasks, deterministic)
                    except ActError as exc:
                        if self._hold(exc, stop):  # the env cannot go on with this episode
                            self._flush(force=True)
                            episode, job, obs = self._start_episode()
                            step, ret, success, chunk = 0, 0.0, False, None
                        continue
                    self._resume()
                    extras = self._chunk_extras(reply_extras)
                    chunk = actions[0]
                    if self.execute:
                        chunk = chunk[: self.execute]
                    ci = 0
                action = np.asarray(chunk[ci], dtype=np.float32)
                index = ci
                first = index == 0
                ci += 1
            self._pace()
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            intervened = bool(info.get("intervened", False))
            executed = np.asarray(info["human_action"], np.float32) if intervened else action
            success = bool(info.get("is_success", False))  # the episode's outcome is its last step's
            self._record(
                obs, action=executed, reward=np.float32(reward), terminated=bool(terminated),
                truncated=bool(truncated), intervened=intervened, is_last=False,
                success=bool(info.get("is_success", False)), policy_version=version,
                episode=episode, step=step, chunk_start=first and not intervened,
                chunk_index=index, group_id=group, **extras,
            )
            if self.on_step is not None:
                self.on_step(obs, executed, float(reward), intervened, version, episode, step)
            self.steps += 1
            ret += float(reward)
            step += 1
            self.episode, self.episode_step, self.episode_return = episode, step, ret
            self.in_control, self.version = ("human" if intervened else "policy"), version
            self.interventions += int(intervened)
            obs = next_obs
            if intervened:
                chunk = None  # ask the policy again once the human lets go
                if self.rtc is not None:
                    self.rtc.reset()
            if terminated or truncated:
                self._record(
                    obs, action=np.zeros_like(action), reward=np.float32(0.0), terminated=False,
                    truncated=False, intervened=False, is_last=True, success=success,
                    policy_version=version, episode=episode, step=step, chunk_start=False,
                    chunk_index=0, group_id=group, **self._zero_extras(),
                )
                self._flush(force=True)
                self.episodes += 1
                self.returns.append(ret)
                self.successes.append(float(success))
                if max_episodes and self.episodes >= max_episodes:
                    break  # do not reserve (or take a job for) an episode that will not run
                episode, job, obs = self._start_episode()
                step, ret, success, chunk = 0, 0.0, False, None
                if self.rtc is not None:
                    self.rtc.reset()
            else:
                self._flush()
            now = time.monotonic()
            if now - last_log >= self.log_every_s:
                rate = (self.steps - last_steps) / (now - last_log)
                log.info(
                    "steps %d | %.0f steps/s | episodes %d | return %.2f | success %.2f | version %d"
                    " | unacked %d | dead letters %d | act %.1f ms (run p50 %s, p99 %s) | act failures %d",
                    self.steps, rate, self.episodes, np.mean(self.returns) if self.returns else float("nan"),
                    np.mean(self.successes) if self.successes else float("nan"),
                    version, len(spool), getattr(spool, "dead_letters", 0), self.client.last_act_ms,
                    *_run_percentiles(self.client), self.act_failures,
                )
                last_log, last_steps = now, self.steps
        self._flush(force=True)
