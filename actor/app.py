"""The actor process: env + connection + (remote or local) policy + loop.

Both policy modes give the loop the same thing per query: actions [1, H, A], the policy
version and the policy extras ``{"extra.<name>": [1, *shape]}``. When the learner hands out
jobs (its welcome says so) the loop asks for one before every reset.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import zmq
from omegaconf import DictConfig, OmegaConf

from actor.client import LearnerClient
from data.stops import StopSignals
from actor.console import LiveView, actor_status, render
from actor.loop import ActorLoop, actor_seed
from actor.rtc import RtcChunker
from actor.rerun_live import make_rerun
from actor.spool import Spool
from envs.registry import make_env
from data.core.spec import config_hash
from envs.spec import spec_from_env

log = logging.getLogger("tandem.actor")


def validate(cfg: DictConfig) -> None:
    if cfg.mode not in ("remote", "local"):
        raise ValueError(f"mode must be remote or local, got {cfg.mode!r}")
    if not cfg.actor_id or "/" in str(cfg.actor_id):
        raise ValueError(f"actor_id must be a non-empty name without '/', got {cfg.actor_id!r}")
    if cfg.chunk.execute < 0:
        raise ValueError(f"chunk.execute must be >= 0, got {cfg.chunk.execute}")
    if cfg.chunk.get("rtc", False) and cfg.mode != "remote":
        raise ValueError("chunk.rtc=true needs mode=remote: the learner serves real-time chunking "
                         "(its rtc.enabled=true); a local policy copy does not")
    if float(cfg.chunk.get("control_hz", 0) or 0) < 0:
        raise ValueError(f"chunk.control_hz must be >= 0, got {cfg.chunk.control_hz}")
    if cfg.spool.batch_size < 1:
        raise ValueError(f"spool.batch_size must be >= 1, got {cfg.spool.batch_size}")
    if cfg.mode == "local":
        _require("torch", "mode=local (the policy runs on this box)", "local-policy")
    if str(cfg.get("rerun", "none") or "none") != "none":
        _require("rerun", f"rerun={cfg.rerun}", "viz")


#: the install that lacks a module gets this hint (README, "Two installs")
THIN_HINT = "uv sync --frozen --no-default-groups --group {group}"


def _require(module: str, what: str, group: str) -> None:
    """A clear start-up error when a thin install (``--no-default-groups``) lacks ``module``."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {module}, which this install lacks (a thin install: "
                         f"add it with `{THIN_HINT.format(group=group)}`, or `uv sync --frozen` "
                         "for everything)")


def make_intervention(icfg):
    """The configured human-intervention source (started), or None."""
    device = icfg.device
    if device in (None, "none"):
        return None
    from envs.intervention import ScriptedIntervention, make_source

    if device == "scripted":
        if not icfg.takeover_steps or not icfg.action:
            raise ValueError("intervention.device=scripted needs intervention.takeover_steps and "
                             "intervention.action")
        src = ScriptedIntervention(takeover=list(icfg.takeover_steps),
                                   action=np.asarray(list(icfg.action), np.float32), env_space=True)
        src.start()
        return src
    if device == "expert":  # a scripted person: bound to the env by the Actor
        return make_source("expert", **OmegaConf.to_container(icfg.expert, resolve=True))
    return make_source(device)


def _quit_requested(env) -> bool:
    while env is not None:
        if getattr(env, "quit_requested", False):
            return True
        env = getattr(env, "env", None)
    return False


class Actor:
    def __init__(self, cfg: DictConfig):
        validate(cfg)
        self.cfg = cfg
        self.intervention = make_intervention(cfg.intervention)
        self.env = make_env(cfg.env, intervention=self.intervention,
                            intervention_kwargs={"action_map": None if cfg.intervention.action_map is None
                                                else list(cfg.intervention.action_map)})
        bind = getattr(self.intervention, "bind", None)
        if bind is not None:  # a source that needs the env (the scripted expert)
            self.env = bind(self.env)
        self.spec = spec_from_env(self.env)
        chunk = int(cfg.policy.chunk_size)
        if cfg.chunk.execute > chunk:
            raise ValueError(f"chunk.execute={cfg.chunk.execute} exceeds policy.chunk_size={chunk}")
        self.config_hash = config_hash(self.spec, env_name=cfg.env.name, policy_name=cfg.policy.name,
                                       chunk=chunk)
        self.ctx = zmq.Context()
        t = cfg.transport
        self.spool = Spool(Path(cfg.spool.dir), max_bytes=int(cfg.spool.max_mb * (1 << 20)),
                           fsync=bool(cfg.spool.fsync))
        self.client = LearnerClient(
            ctx=self.ctx, host=t.host, port=t.port, actor_id=str(cfg.actor_id),
            config_hash=self.config_hash, spool=self.spool, timeout_s=t.timeout_s,
            heartbeat_s=t.heartbeat_s, reconnect_after=t.reconnect_after,
            security=OmegaConf.to_container(t.security, resolve=True),
            max_message_bytes=int(t.max_message_mb * (1 << 20)),
        )
        self.local = None
        if cfg.mode == "local":
            try:
                from actor.local_policy import LocalPolicy

                self.local = LocalPolicy(cfg.policy, self.spec, ctx=self.ctx, host=t.host, pub_port=t.pub_port,
                                         security=OmegaConf.to_container(t.security, resolve=True))
            except ModuleNotFoundError as exc:  # torch is there (validate); the policy's library not
                self.close()
                raise ValueError(f"mode=local policy={cfg.policy.name} needs {exc.name}, which this "
                                 f"install lacks: `{THIN_HINT.format(group='learner')}`") from exc
        #: real-time chunking (actor/rtc.py), or None
        self.rtc = RtcChunker(self.client, self._act, execute=int(cfg.chunk.execute)) if cfg.chunk.get("rtc") else None
        self._stopping = False
        self._signals = StopSignals(on_stop=self._mark_stopping)

    def _act(self, arrays: dict[str, np.ndarray], tasks: list[str], deterministic: bool):
        deterministic = deterministic or self.client.mode == "eval"
        if self.local is not None:
            return self.local.act(arrays, tasks, deterministic)
        return self.client.act(arrays, tasks, deterministic=deterministic)

    def run(self) -> ActorLoop:
        from actor.session import LearnerFinished

        cfg = self.cfg
        # SIGINT and SIGTERM alike, also when started in the background with SIGINT ignored
        self._signals.install()
        loop = ActorLoop(
            self.env, self.client, self._act, actor_id=str(cfg.actor_id),
            batch_size=int(cfg.spool.batch_size), execute=int(cfg.chunk.execute),
            deterministic=bool(cfg.deterministic), seed=actor_seed(cfg.seed, cfg.actor_id), log_every_s=cfg.log_every_s,
            on_poll=self._refresh_local if self.local is not None else None,
            get_job=self.client.get_job, control_hz=float(cfg.chunk.get("control_hz", 0) or 0),
            rtc=self.rtc)
        self.rerun = make_rerun(cfg, str(cfg.actor_id))
        if self.rerun is not None:
            loop.on_step = self.rerun.log_step
        live = LiveView(lambda: render(actor_status(loop, self.client, device=cfg.intervention.device)),
                        enabled=str(cfg.get("live", "auto")) != "false", refresh_per_second=4.0).start()
        try:
            self.client.connect()
            if self.local is not None:
                self.local.fetch(self.client)
            loop.run(max_episodes=int(cfg.max_episodes),
                     stop=lambda: self._stopping or _quit_requested(self.env))
            self._drain(float(cfg.drain_s))
        except LearnerFinished as exc:
            log.info("learner finished: %s", exc)
        except KeyboardInterrupt:
            log.info("interrupted: %d records unacknowledged stay in %s", len(self.spool), self.spool.dir)
        finally:
            live.stop()
            if self.rerun is not None:
                self.rerun.close()
            self.close()
            self._signals.restore()
        return loop

    def _drain(self, timeout_s: float = 10.0) -> None:
        """Give the learner a moment to acknowledge what is pending before exiting."""
        import time

        deadline = time.monotonic() + timeout_s
        while len(self.spool) and time.monotonic() < deadline:
            self.client.poll(0.1)

    def _refresh_local(self) -> None:
        self.local.refresh(self.client)

    def _on_term(self, signum, frame):
        """The first SIGINT or SIGTERM interrupts whatever runs (then the actor closes and
        exits, its spool kept); any later one, arriving while it shuts down, is ignored rather
        than breaking the close with a traceback."""
        self._signals.handle(signum, frame)

    def _mark_stopping(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.client.close()
        if self.local is not None:
            self.local.close()
        self.env.close()
        if self.intervention is not None:
            self.intervention.close()
        self.ctx.destroy(linger=0)
