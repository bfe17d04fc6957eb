"""The learner process: wires the service, inference and the algorithm together and runs them.

The algorithm comes as a builder (:class:`agents.core.Builder`, picked by ``algo.name``): it
makes its networks, its data (the sink ingest feeds and what it samples from) and its
learner (update cadence, what it publishes), and may hand actors jobs. Nothing here
depends on which algorithm it is.

Ranks (:mod:`learner.distributed`): with ``gpus`` = N > 1 this is rank 0, which owns the
service, ingest, store, serving copy, versions and checkpoints; its agent's updates are
announced to and shared with ranks 1..N-1 (:class:`learner.distributed.Follower`).

Threads: the socket thread (:mod:`learner.service`), the inference thread
(:mod:`learner.inference`) and this main thread, which steps the algorithm, publishes
weight versions, checkpoints (:mod:`learner.checkpointing`) and logs (its figures:
:mod:`learner.status`).

The env spec comes from the env config (:func:`envs.registry.env_spec`): no simulator is
built or imported here, so ``env=libero_spatial`` starts on a GPU box without LIBERO.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path

import torch
import zmq
from omegaconf import DictConfig, OmegaConf

from agents import registry
from agents.base import extras_ranges
from agents.policies.pi0.rtc import RtcSettings, check_rtc_pair
from data.core.spec import EnvSpec, config_hash
from envs.registry import env_spec
from learner.actor_stats import ActorStats
from learner.checkpointing import Checkpointer
from data.stops import StopSignals
from learner.console import LiveView, render
from learner.distributed import (RankError, Ranks, RootRoute, check_shared_run_dir, check_world, cpu_offload,
                                 gathered_trainable, intra_op_threads, make_accelerator, needs_gather)
from learner.eval_report import EvalVideos, write_eval_report
from learner.inference import InferenceServer
from learner.serving_window import LEAD, ServingWindow
from learner.ingest import Ingest
from learner.eval_sweep import EvalSweep
from learner.jobs import JobQueue
from learner.metrics import LoopClock, MetricsLogger
from learner.rank_control import CTRL_GATHER, CTRL_IDLE, CTRL_STOP
from learner.service import LearnerService
from learner.status import LearnerStatus
from learner.weights import WeightPublisher

log = logging.getLogger("tandem.learner")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return dev


def serving_device(cfg: DictConfig, learner_device: torch.device) -> torch.device:
    """Where the serving copy runs: ``inference.device`` (e.g. ``cuda:1``, a GPU of its own so
    that acts do not queue behind training kernels), else the learner's device."""
    name = cfg.inference.get("device")
    if not name:
        return learner_device
    dev = pick_device(str(name))
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"inference.device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


#: torch.set_float32_matmul_precision's settings (trainer.matmul_precision)
MATMUL_PRECISIONS = ("highest", "high", "medium")


def validate(cfg: DictConfig) -> None:
    if cfg.mode not in ("train", "eval"):
        raise ValueError(f"mode must be train or eval, got {cfg.mode!r}")
    if cfg.resume not in ("auto", "never", "must"):
        raise ValueError(f"resume must be auto, never or must, got {cfg.resume!r}")
    for key in ("port", "pub_port"):
        p = cfg.transport[key]
        if not isinstance(p, int) or not 0 <= p < 65536:
            raise ValueError(f"transport.{key} must be a port number, got {p!r}")
    mp = cfg.trainer.matmul_precision
    if mp not in MATMUL_PRECISIONS:
        raise ValueError(f"trainer.matmul_precision must be one of {MATMUL_PRECISIONS}, got {mp!r}")
    if cfg.buffer.capacity < cfg.algo.get("batch_size", 1):
        raise ValueError(f"buffer.capacity ({cfg.buffer.capacity}) < algo.batch_size "
                         f"({cfg.algo.batch_size})")
    registry.check_algo_policy(cfg.algo, cfg.policy)
    check_rtc_pair(RtcSettings.from_config(cfg.get("rtc")), cfg.algo, cfg.policy)  # agents/policies/pi0/rtc.py


class Learner:
    """Builds and owns everything; :meth:`run` blocks until stopped."""

    def __init__(self, cfg: DictConfig):
        validate(cfg)
        self.cfg = cfg
        self.stopped: dict | None = None  # why and on what figure the run stopped itself
        torch.manual_seed(cfg.seed)
        self.device = pick_device(cfg.device)
        threads = intra_op_threads(cfg.trainer.get("num_threads"), gpu=self.device.type == "cuda",
                                   offload=cpu_offload(cfg))
        if threads:
            torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(str(cfg.trainer.matmul_precision))
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator = make_accelerator(self.device.type == "cpu", cfg.distributed.timeout_s)
        self.ranks = Ranks(self.accelerator)
        check_world(cfg, self.ranks.world, cfg.algo.name)
        check_shared_run_dir(self.ranks, self.run_dir)
        if self.ranks.world > 1:
            self.device = self.accelerator.device  # this rank's GPU (cuda:0 on rank 0)
        env = env_spec(cfg.env)
        self.config_hash = config_hash(env, env_name=cfg.env.name, policy_name=cfg.policy.name,
                                       chunk=int(cfg.policy.chunk_size))
        self.builder = registry.build_builder(cfg.algo)
        # the policy the algorithm trains and serves (its builder may wrap it: noise-space SAC)
        policy = registry.build_trained_policy(self.builder, cfg.policy, env)
        # records carry the policy's extras (log_prob, noise, tokens, ...): declared once here
        self.spec: EnvSpec = env.with_extras(policy.extras_spec(), extras_ranges(policy))
        networks = self.builder.make_networks(self.spec, policy, self.device)
        # the algorithm's data: its sink (ingest feeds it), the LeRobot episode store (recovered,
        # refilled from disk) and what it samples from
        self.data = self.builder.make_data(self.spec, cfg.buffer, run_dir=self.run_dir, seed=cfg.seed,
                                           device=str(self.device), train=cfg.mode == "train")
        self.ingest = Ingest(self.data.sink, store=self.data.store, store_transitions=cfg.mode == "train",
                             max_staged_bytes=int(float(cfg.buffer.get("max_staged_mb", 1024)) * (1 << 20)),
                             stats_window=int(cfg.eval.episodes if cfg.mode == "eval"
                                              else cfg.logging.stats_window),
                             on_ack=lambda actor, seq: self._push_ack(actor, seq))
        self.algo = self.builder.make_learner(networks, self.data, self.accelerator,
                                              env_steps=lambda: self.ingest.steps)
        if self.ranks.world > 1:  # every update is announced to and shared with the other ranks
            self.algo.route = RootRoute(self.ranks)
        # what the operator sees (learner/console.py): per-actor numbers fed by the threads
        self.actor_stats = ActorStats(window=int(cfg.logging.stats_window))
        self.eval_videos = EvalVideos(self.spec) if cfg.mode == "eval" else None
        self.ingest.on_records = self._on_records
        self.status = LearnerStatus(self)  # the figures: logs, the live view, status.json
        self.serving_device, self.rtc = serving_device(cfg, self.device), RtcSettings.from_config(cfg.get("rtc"))
        # built with that GPU current: policies that say "cuda" (lerobot's PI0) land on it too
        with torch.cuda.device(self.serving_device) if self.serving_device.type == "cuda" else contextlib.nullcontext():
            serving = registry.build_trained_policy(self.builder, cfg.policy, env).to(self.serving_device).eval()
        # time-slicing the one GPU (learner/serving_window.py): training waits at its next matmul
        # while a batch is served
        self.window = None
        if cfg.inference.get("serving_window"):
            if self.serving_device != self.device:
                raise ValueError(f"inference.serving_window=true time-slices one device, but serving runs on "
                                 f"{self.serving_device} and training on {self.device}: drop one of the two")
            self.window = ServingWindow(lead=int(cfg.inference.get("serving_window_lead", LEAD)))
            self.window.attach(policy)
        self.jobs = self.builder.jobs() or (JobQueue.from_config(list(cfg.jobs)) if cfg.jobs else None)
        self.sweep = None  # mode=eval with eval.sweep: every (task, init state) once, as jobs
        if cfg.mode == "eval" and cfg.eval.get("sweep"):
            self.sweep = EvalSweep.from_config(OmegaConf.to_container(cfg.eval.sweep, resolve=True))
            self.jobs = self.sweep
        self.ctx = zmq.Context()
        t = cfg.transport
        self.service = LearnerService(
            ctx=self.ctx, spec=self.spec, config_hash=self.config_hash, ingest=self.ingest,
            submit_act=self._submit_act, get_version=lambda: self.weights.version,
            get_weights=lambda: self.weights.latest(), host=t.host, port=t.port, pub_port=t.pub_port,
            act_port=t.get("act_port"), act_socket=bool(t.get("act_socket", True)), max_message_bytes=int(t.max_message_mb * (1 << 20)), peer_timeout_s=t.peer_timeout_s,
            gate_memory_bytes=int(float(t.get("gate_memory_mb", 4096)) * (1 << 20)),
            max_actor_ids=int(t.get("max_actor_ids", 4096)),
            mode=cfg.mode, security=OmegaConf.to_container(t.security, resolve=True),
            next_job=None if self.jobs is None else self.jobs.next_job,
            on_fatal=self._service_died, rtc_chunk=int(cfg.policy.chunk_size) if self.rtc.enabled else 0,
        )
        self.inference = InferenceServer(
            serving, reply=self._reply_act, active_actors=self.service.active_actors,
            device=self.serving_device, max_batch=cfg.inference.max_batch,
            batch_window_ms=cfg.inference.batch_window_ms,
            batch_due_ms=float(cfg.inference.get("batch_due_ms", 0.0)),
            act_channel=self.service.act_channel,  # acts on their own socket (learner/act_channel.py)
            rtc=self.rtc, cuda_stream=str(cfg.inference.get("cuda_stream", "priority")),
            compile_artifacts=cfg.inference.get("compile_artifacts"),
            warmup=str(cfg.inference.get("warmup", "staged")),
            # its own generator (seed + an offset): serving never draws from the global RNG that
            # training draws from, so the acts served while it trains do not change its stream
            seed=int(cfg.seed), window=self.window)
        self.weights = WeightPublisher(self.inference.set_weights, self.service.publish)
        self._stop = threading.Event()
        self.checkpoints = Checkpointer(
            root=self.run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints, resume=cfg.resume, mode=cfg.mode,
            algo=self.algo, ingest=self.ingest, weights=self.weights, ranks=self.ranks, trainable=self._trainable)
        self.checkpoints.restore()
        self.metrics = MetricsLogger(
            run_dir=self.run_dir, wandb_mode=cfg.logging.wandb, project=cfg.logging.project,
            config=OmegaConf.to_container(cfg, resolve=True), name=f"{cfg.mode}-{cfg.env.name}",
        )

    def save(self) -> Path | None:
        """A checkpoint (:meth:`learner.checkpointing.Checkpointer.save`); None when it could not be written."""
        return self.checkpoints.save(rank_died=getattr(self, "_fatal_rank", None) is not None)

    # ---- running -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` (on another thread) to finish as after Ctrl-C: checkpoint, close."""
        self._stop.set()

    @property
    def port(self) -> int:
        return self.service.port

    def run(self) -> dict:
        cfg = self.cfg
        self._fatal: BaseException | None = None
        self._fatal_rank: RankError | None = None
        self.service.start()
        self.inference.start()
        log.info("learner %s training on %s, serving on %s at %s:%d (pub %d), mode=%s, algo=%s, policy=%s, "
                 "env=%s, config hash %s", self.service.learner_id, self.device, self.serving_device, cfg.transport.host,
                 self.service.port, self.service.pub_port, cfg.mode, cfg.algo.name,
                 cfg.policy.name, cfg.env.name, self.config_hash)
        # SIGINT and SIGTERM alike, also when started in the background with SIGINT ignored
        stops = StopSignals(on_stop=self._stop.set)
        stops.install()
        result: dict = {}
        live = LiveView(lambda: render(self.status.full("view")), stray_output=str(self.run_dir / "native_output.log"),
                        enabled=str(cfg.logging.get("live", "auto")) != "false").start()
        try:
            result = self._eval_loop() if cfg.mode == "eval" else self._train_loop()
        except KeyboardInterrupt:
            log.info("interrupted: stopping")
        except RankError as exc:  # checkpoint (rank 0 holds the whole state under DDP), then fail
            log.error("%s: the learner stops", exc)
            self._fatal_rank = exc
        finally:
            live.stop()
            if cfg.mode == "train" and self.algo.updates > 0:
                try:  # with the other ranks still following (they write their engine state)
                    log.info("checkpoint %s", self.save())
                except RankError as exc:
                    log.error("%s: no final checkpoint", exc)
                    self._fatal_rank = exc
            self._stop_ranks()
            self.status.write()
            self.close()
            stops.restore()
            if self._fatal_rank is not None:
                raise RuntimeError(f"a learner rank died ({self._fatal_rank}); the run stopped "
                                   "after a checkpoint: restart it with the same --gpus") from self._fatal_rank
            if self._fatal is not None:  # replaces what the main thread hit on the dead sockets
                raise RuntimeError(f"the socket thread died ({type(self._fatal).__name__}: "
                                   f"{self._fatal}); the learner stopped") from self._fatal
        return result

    def _stop_ranks(self) -> None:
        """Tell the other ranks to finish (once; not after a rank failure)."""
        if self.ranks.world > 1 and self._fatal_rank is None and not getattr(self, "_ranks_stopped", False):
            self._ranks_stopped = True
            try:
                self.ranks.send(CTRL_STOP)
            except RankError as exc:
                log.error("%s", exc)

    def _heartbeat(self) -> None:
        """Nothing to train on: let the other ranks know rank 0 is alive (rate-limited)."""
        now = time.monotonic()
        if self.ranks.world > 1 and now - getattr(self, "_last_beat", 0.0) >= self.cfg.distributed.heartbeat_s:
            self.ranks.send(CTRL_IDLE)
            self._last_beat = now

    def _trainable(self) -> dict:
        """The weights to publish; under ZeRO-3 gathered from every rank's shard."""
        if self.ranks.world > 1 and needs_gather(self.accelerator):
            self.ranks.send(CTRL_GATHER)
        return gathered_trainable(self.algo.policy, self.accelerator)

    def _service_died(self, exc: BaseException) -> None:  # the dying socket thread
        """No half-alive learner: stop the main loop; :meth:`run` checkpoints and raises."""
        self._fatal = exc
        self._stop.set()

    def _push_ack(self, actor_id: str, seq: int) -> None:
        """Records became durable (episode store commit): tell the actor now."""
        for ident, peer in list(self.service.peers.items()):
            if peer.actor_id == actor_id:
                self.service.reply(ident, self.service.ack_frames(actor_id, seq))

    def _submit_act(self, req) -> None:  # socket thread, or the inference thread (act socket)
        if req.actor_id:
            self.actor_stats.on_act(req.actor_id, req.identity, req.t_recv)
        self.inference.submit(req)

    def _reply_act(self, identity: bytes, frames: list) -> None:  # inference thread
        self.actor_stats.on_reply(identity)
        self.service.reply(identity, frames)

    def _on_records(self, batch, keep) -> None:  # socket thread, under ingest's lock
        self.actor_stats.on_records(batch, keep)
        if self.eval_videos is not None:
            self.eval_videos.on_records(batch, keep)
        if self.sweep is not None:
            self.sweep.on_records(batch, keep)

    def close(self) -> None:
        self.data.close()  # writes queued episodes first, while the service can still ack
        self.inference.stop()
        self.inference.join(timeout=5)  # before the service closes the threads' outbox sockets
        self.service.stop()
        self.service.join(timeout=5)
        self.metrics.close()
        self.ctx.destroy(linger=0)

    def _train_loop(self) -> dict:
        cfg = self.cfg.trainer
        last_log, last_updates, last_ckpt = time.monotonic(), self.algo.updates, self.algo.updates
        last_ckpt_t, every_s = time.monotonic(), float(cfg.get("checkpoint_every_s", 0) or 0)
        metrics: dict[str, float] = {}
        clock = LoopClock()  # where the main thread's time goes: updating, publishing, saving
        while not self._stop.is_set():
            t0 = time.monotonic()
            m = self.algo.step()
            if m:
                clock.spent["busy"] += time.monotonic() - t0
                metrics = m
                self.status.note_skips()
                if self.algo.should_publish():
                    with clock.timed("publish_s"):
                        self.weights.publish(self._trainable())
                if ((cfg.checkpoint_every and self.algo.updates - last_ckpt >= cfg.checkpoint_every)
                        or (every_s and time.monotonic() - last_ckpt_t >= every_s)):
                    with clock.timed("checkpoint_s"):
                        self.save()
                    last_ckpt, last_ckpt_t = self.algo.updates, time.monotonic()
            else:
                self._heartbeat()
                time.sleep(0.005)
            now = time.monotonic()
            if now - last_log >= self.cfg.logging.every_s:
                status = {k: v for k, v in self.status.full().items() if isinstance(v, (int, float))}
                status["updates_per_s"] = (self.algo.updates - last_updates) / (now - last_log)
                status.update(clock.period(now - last_log, self.algo.updates - last_updates))
                status.update(self.actor_stats.take_period())  # act latency of this period
                self.metrics.log({**status, **metrics}, step=self.algo.updates, console_keys=[
                    "updates", "updates_per_s", "version", "env_steps", "episodes", "return",
                    "success", "actors", "infer_batch"])
                last_log, last_updates = now, self.algo.updates
                self.status.write()
            if cfg.max_updates and self.algo.updates >= cfg.max_updates:
                break
            s = self.ingest.stats.summary()
            if (cfg.stop_at_success and s.get("episodes", 0) >= cfg.stop_min_episodes
                    and s.get("success", 0.0) >= cfg.stop_at_success):
                window = min(int(s["episodes"]), self.cfg.logging.stats_window)
                log.info("success %.2f >= %.2f over the last %d episodes: done", s["success"],
                         cfg.stop_at_success, window)
                # the figure that decided the stop: episodes keep arriving until the status is written
                self.stopped = {"reason": "stop_at_success", "success": float(s["success"]),
                                "episodes": int(s["episodes"]), "window": window,
                                "updates": self.algo.updates}
                break
        return self.status.summary()

    def _eval_loop(self) -> dict:
        target, sweep = int(self.cfg.eval.episodes), self.sweep
        last_log = time.monotonic()
        while not (sweep.done if sweep else self.ingest.stats.episodes >= target) and not self._stop.is_set():
            time.sleep(0.05)
            if sweep is not None:
                sweep.reissue_timed_out()
            if time.monotonic() - last_log >= self.cfg.logging.every_s:
                self.metrics.log(self.status.summary(), step=self.ingest.stats.episodes,
                                 console_keys=["episodes", "return", "success", "actors"])
                self.status.write()
                last_log = time.monotonic()
        if sweep is not None:
            report = {"version": self.weights.version, **sweep.report()}
            report["episodes"] = report["overall"]["episodes"]
        else:
            report = {"version": self.weights.version, "episodes": self.ingest.stats.episodes,
                      "overall": self.ingest.stats.summary(), "per_task": self.ingest.stats.per_task()}
        (self.run_dir / "eval_report.json").write_text(json.dumps(report, indent=2))
        for path in write_eval_report(self.run_dir, report, videos=self.eval_videos):
            log.info("evaluation report: %s", path)
        log.info("evaluation of policy version %d over %d episodes:", report["version"], report["episodes"])
        for task, r in report["per_task"].items():
            log.info("  %-40s success %.2f  return %.2f  (%d episodes)", task, r["success"],
                     r["return"], r["episodes"])
        self.service.finished = True
        time.sleep(min(3.0, 2 * self.cfg.transport.heartbeat_s + 0.5))  # let actors hear it
        return report
