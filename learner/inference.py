"""Batched action serving on its own thread.

Requests queued by the socket thread are gathered into one forward pass: the thread takes
every request waiting, and when fewer than the number of active actors are waiting it
lingers up to ``batch_window_ms`` for the rest, so that with a request in flight from each
of N actors one forward of batch N runs. With ``batch_due_ms`` it also lingers, up to that long,
for an actor whose next request is due by then (its last reply plus its last think time:
:mod:`learner.arrivals`), so that closed-loop simulated actors, which return within tens of ms
of one another, are served in one forward and stay in step. Requests come from the socket thread (``submit``,
which wakes this thread through a pipe) and, when the server was given the service's
``act_channel``, straight from the act socket, which this thread polls, validates and
answers itself (:mod:`learner.act_channel`: no thread hand-off on the act path). It owns a
serving copy of the policy; the trainer
hands it new trainable weights through :meth:`set_weights` and they are loaded between
forwards, so every reply carries exactly the version that produced it.

A reply holds ``actions`` [n, H, A] float32 and, for each extra the policy declares in
``extras_spec()`` (name -> (dtype, per-chunk shape)), ``extra.<name>`` [n, *shape] in the
declared dtype: the request's rows of ``chunk.extras_with_log_prob()``. A policy that
returns an extra it did not declare, or misses one, gets every request of the batch an
``inference_failed`` error naming it.

Real-time chunking (``rtc``: the learner's ``rtc`` settings, when enabled): a batch with any
request carrying RTC arrays (its pending prefix and delay, checked by the service) calls
``policy.act(obs, rtc=RtcRows)`` with one row per observation; the rows of requests without
RTC get ``pending`` 0 and are served as plain acts in the same forward
(:mod:`agents.policies.pi0.rtc`). A batch without RTC rows calls ``policy.act`` as before.

On a GPU, serving runs on a CUDA stream of its own (``cuda_stream``): ``priority`` (the default)
is a non-blocking stream at the device's highest priority, so an act's kernels are scheduled
ahead of training's queued ones and its copy back waits only for its own work; ``own`` is such a
stream at normal priority; ``shared`` serves on the thread's default stream, where an act queues
behind every kernel the trainer has already launched on the same GPU.

A policy with a ``warm_up`` method (PI0 / PI0.5 and OFT's fast paths: compile and capture the
CUDA graphs of the batch sizes it will serve) is warmed up by :mod:`learner.warmup` when the
server is built, with the serving device current: that is before the learner starts its
service. ``warmup="staged"`` (the default) warms only the smallest bucket then, caps batches at
the largest bucket warmed, and warms the others on this thread between batches; ``"all"`` warms
every bucket first. With ``compile_artifacts`` (a folder: ``inference.compile_artifacts``) the
portable compile artefacts for this GPU and torch are loaded from it before the warm-up and
what it compiled is saved there after it.

Randomness. The server owns a ``torch.Generator`` on its device, seeded with ``seed +``
:data:`SERVING_SEED_OFFSET` (the learner passes the run's seed), and hands it to every
``policy.act`` as ``generator=`` when the policy's act takes that keyword (looked up once, at
construction; a policy without it draws from torch's global RNG as before). Serving then never
draws from the global RNG, which the trainer on the main thread draws from (flow-matching noise
and times, dropout): how many acts happen to be served while it trains no longer changes its
random stream, so two runs with the same seed train alike whatever their actors do. The warm-up
runs inside ``torch.random.fork_rng`` (the global state is put back after it). Which noise a
request gets still depends on the batches the server happens to form (one draw per batch).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch
import zmq

from data.core.codec import encode
from agents.policies.pi0.rtc import RtcRows, RtcSettings
from data.core.schema import RTC_DELAY, RTC_PENDING, RTC_PREFIX, TASK
from data.core.transitions import extras_to_numpy
from learner.act_channel import ActChannel
from learner.act_intake import ActRequest
from learner.arrivals import Arrivals
from learner.serving_window import ServingWindow
from learner.warmup import Warmup

log = logging.getLogger("tandem.learner.inference")

#: where serving's kernels go on a GPU (InferenceServer's ``cuda_stream``)
CUDA_STREAMS = ("priority", "own", "shared")


def serving_stream(device: torch.device, mode: str) -> torch.cuda.Stream | None:
    """The CUDA stream serving runs on (``mode`` as in :data:`CUDA_STREAMS`); None for
    ``shared`` or off a GPU. PyTorch's pool streams are non-blocking: no implicit wait on the
    legacy default stream the trainer launches on."""
    if device.type != "cuda" or mode == "shared":
        return None
    _low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): numerically high -> low
    return torch.cuda.Stream(device=device, priority=high if mode == "priority" else 0)

#: added to the server's ``seed`` (the run's) for its generator: serving's stream differs from
#: the one ``torch.manual_seed(seed)`` gives the trainer
SERVING_SEED_OFFSET = 0x5E57E


def accepts_generator(act: Callable) -> bool:
    """Whether ``act`` (a policy's bound ``act``) names a ``generator`` parameter."""
    try:
        params = inspect.signature(act).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("generator")
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class InferenceServer(threading.Thread):
    def __init__(
        self,
        policy,
        *,
        reply: Callable[[bytes, list], None],
        active_actors: Callable[[], int],
        device: torch.device,
        max_batch: int = 64,
        batch_window_ms: float = 2.0,
        batch_due_ms: float = 0.0,
        autocast_dtype: torch.dtype | None = None,
        act_channel: ActChannel | None = None,
        rtc: RtcSettings | None = None,
        cuda_stream: str = "priority",
        compile_artifacts: str | None = None,
        warmup: str = "staged",
        seed: int = 0,
        window: ServingWindow | None = None,
    ):
        super().__init__(name="tandem-inference", daemon=True)
        if cuda_stream not in CUDA_STREAMS:
            raise ValueError(f"inference.cuda_stream must be one of {', '.join(CUDA_STREAMS)}, got {cuda_stream!r}")
        #: priority | own | shared (module docstring); ignored off a GPU
        self.cuda_stream = cuda_stream
        #: held open around every batch: a trainer hooked to it waits at its next layer
        self.window = window
        self.policy = policy
        #: the generator every act draws from (module docstring, "Randomness")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(seed) + SERVING_SEED_OFFSET)
        #: ``generator=`` for the policy's act, or nothing when its act does not take one
        act = getattr(policy, "act", None)
        self._act_kw = {"generator": self.generator} if callable(act) and accepts_generator(act) else {}
        if callable(act) and not self._act_kw:
            log.warning("%s.act takes no generator: serving draws from torch's global RNG, which training "
                        "shares", type(policy).__name__)
        #: real-time chunking settings (requests with RTC arrays are served with them), or None
        self.rtc = rtc if rtc is not None and rtc.enabled else None
        self.reply = reply
        self.active_actors = active_actors
        self.device = device
        self._on_cpu = device.type == "cpu"
        self.max_batch = max_batch
        self.window_s = batch_window_ms / 1000.0
        #: also linger up to this long for an actor whose next request is due (learner/arrivals.py)
        self.due_s = max(0.0, float(batch_due_ms)) / 1000.0
        self.arrivals = Arrivals() if self.due_s > 0 else None
        self.autocast_dtype = autocast_dtype
        self.version = 0
        spec_fn = getattr(policy, "extras_spec", None)
        #: the policy's declared extras: name -> (dtype, per-chunk shape)
        self.extras_spec = dict(spec_fn()) if callable(spec_fn) else {}
        # deque: append/popleft are atomic, and far cheaper than queue.Queue's locks
        self.requests: deque[ActRequest] = deque()
        self._pending: tuple[int, dict] | None = None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self.batches = 0
        self.served = 0
        #: requests dropped unserved because a newer one from the same sender was queued
        #: (``_take``); ``_latest``: sender -> its newest queued req_id
        self.superseded = 0
        self._latest: dict[bytes, int] = {}
        self.batch_sizes: list[int] = []
        #: the last forwards: (perf_counter at the batch's start, requests, ms from its start
        #: to its actions on the host)
        self.recent: deque[tuple[float, int, float]] = deque(maxlen=4096)
        self.channel = act_channel
        if act_channel is not None:
            act_channel.claim()
        # submit() from another thread wakes this one through a pipe it polls with the act socket
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._ident: int | None = None
        self._wake_lock = threading.Lock()  # the pipe is closed when the thread ends
        self._wake_open = True
        #: the policy's warm-up (learner/warmup.py): the first bucket (staged) or all now
        self.warmup = Warmup(policy, device=device, max_batch=max_batch, autocast_dtype=autocast_dtype,
                             compile_artifacts=compile_artifacts, mode=warmup)
        self.warmup.start()

    @property
    def warmup_s(self) -> dict[int, float]:
        """{batch size: seconds} of the policy's warm-up so far ({} when it has none)."""
        return self.warmup.buckets

    def submit(self, req: ActRequest) -> None:
        # (one sender's requests arrive in order on one thread: the newest id is the last one)
        self._latest[req.identity] = req.req_id
        self.requests.append(req)
        if threading.get_ident() != self._ident:
            with self._wake_lock:
                if self._wake_open:
                    try:
                        os.write(self._wake_w, b"w")
                    except BlockingIOError:  # full: a wake-up is already pending
                        pass

    def set_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Queue ``state`` as ``version`` (loaded before the next forward). GPU tensors made on
        the caller's stream get an event recorded there: serving's own stream waits for it."""
        ready = None
        dev = next((t.device for t in state.values() if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if dev is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
        with self._lock:
            self._pending = (version, state, ready)

    def stop(self) -> None:
        self._stop_event.set()

    def _apply_pending(self) -> None:
        if self._pending is None:  # (read without the lock: set_weights' next write is seen next batch)
            return
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            version, state, ready = pending
            if ready is not None:  # the trainer's copies are complete before serving reads them
                torch.cuda.current_stream(self.device).wait_event(ready)
            self.policy.load_trainable_state_dict(state)
            if ready is not None:
                # the copies were allocated on the trainer's stream: hold them until this
                # stream has read them, or the allocator could hand their memory out again
                torch.cuda.current_stream(self.device).synchronize()
            self.version = version

    def _wait(self, timeout_s: float, limit: int = 256) -> None:
        """Block up to ``timeout_s`` for a wake-up or the act socket; move up to ``limit``
        requests waiting on the act socket into the queue (the act channel validates them)."""
        wake_r, ch = self._wake_r, self.channel
        for sock, _ in zmq.zmq_poll(self._poller.sockets, max(0, int(timeout_s * 1000 + 0.999))):
            if sock is wake_r or sock == wake_r:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif ch is not None and sock is ch.sock:
                ch.read(ready=True, limit=limit)

    def _take(self, reqs: list[ActRequest], n: int) -> int:
        """Move queued requests into ``reqs`` up to ``warmup.cap`` rows (``max_batch`` once the
        warm-up is done). A request that a newer one from the same sender (routing id) has
        superseded is dropped unserved and counted in
        ``superseded``: a client waits for its latest request only (it resends after its
        timeout, with a new ``req_id``, and drops late replies), so under overload serving the
        old one would spend the device on a reply nobody reads while the resend waits. (With one
        active actor the act socket is read one request at a time, so a backlog of that one
        sender's resends is served in turn; it matters where many senders queue.)"""
        q, latest, cap = self.requests, self._latest, self.warmup.cap
        while q and n < cap:
            r = q.popleft()
            newest = latest.get(r.identity)
            if newest is not None and newest > r.req_id:
                self.superseded += 1
                continue
            if newest == r.req_id:  # nothing newer from this sender is queued
                del latest[r.identity]
            if self.arrivals is not None:
                self.arrivals.arrived(r.identity, r.t_recv)
            reqs.append(r)
            n += r.n
        return n

    def _gather(self) -> list[ActRequest]:
        reqs: list[ActRequest] = []
        cap = self.warmup.cap  # max_batch, or the largest bucket warmed while the warm-up is staged
        n = self._take(reqs, 0)
        if not reqs:
            # one active actor: read its request without asking the socket whether another
            # one waits (any other stays queued for the next poll); else every waiting one
            want = self.active_actors()
            self._wait(0.1, 1 if want == 1 else 256)
            n = self._take(reqs, 0)
            if not reqs:
                return []
            if n >= cap or len(reqs) >= want > 0:
                return reqs
        elif n >= cap:
            return reqs
        want = self.active_actors()  # (senders just read count as active now)
        if len(reqs) >= want:  # every active actor's request is here: no lingering
            return reqs
        t0 = time.perf_counter()
        deadline, due_limit = t0 + self.window_s, t0 + self.due_s
        while n < cap and len(reqs) < want:
            now = time.perf_counter()
            until = deadline
            if self.arrivals is not None:  # an actor due within batch_due_ms of the first request
                due = self.arrivals.expected(now, due_limit)
                if due is not None and due > until:
                    until = due
            left = until - now
            if left <= 0:
                break
            self._wait(left)
            n = self._take(reqs, n)
        return reqs

    def run(self) -> None:
        self._ident = threading.get_ident()
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # "cuda" inside the policy means the serving GPU
        if self.channel is not None:
            if self.channel.attach_thread():
                self._poller.register(self.channel.sock, zmq.POLLIN)
            else:
                self.channel = None
        torch.set_grad_enabled(False)
        # the process's intra-op thread count (trainer.num_threads) for this thread too: set in
        # the main thread, it does not reach a new thread's OpenMP team, whose first MKL/oneDNN
        # call (a Linear) would start one of every core, its workers spinning between batches
        torch.set_num_threads(torch.get_num_threads())
        stream = serving_stream(self.device, self.cuda_stream)
        if stream is not None:  # the serving copy's build and warm-up ran on the default stream
            stream.wait_stream(torch.cuda.default_stream(self.device))
        try:
            # once for the thread: entering inference mode per batch costs ~10-50 us
            with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None
                                          else contextlib.nullcontext()):
                self._loop()
        finally:
            if self.channel is not None:
                self.channel.close()
            with self._wake_lock:
                self._wake_open = False
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)

    def _loop(self) -> None:
        while not self._stop_event.is_set():
            reqs = self._gather()
            if not reqs:
                self._apply_pending()
                if self.warmup.pending:  # idle: warm the next bucket (staged warm-up)
                    self.warmup.next()
                continue
            # (a serving window covers the weights' load too: its copies run alone, as the act)
            with self.window.serving() if self.window is not None else contextlib.nullcontext():
                self._apply_pending()  # the newest weights serve this batch
                self._serve_all(reqs)
            if self.warmup.pending and sum(r.n for r in reqs) >= self.warmup.cap and (
                    self.requests or self.active_actors() > len(reqs)):
                # batches are being cut by the cap (more queued, or more actors than it; theirs
                # may wait on the act socket, not in the queue): the next bucket now
                self.warmup.next()

    def _serve_all(self, reqs: list[ActRequest]) -> None:
        """One gathered batch: grouped by deterministic or sampled, each group one forward."""
        det0 = reqs[0].deterministic
        if len(reqs) == 1 or all(r.deterministic == det0 for r in reqs):
            groups = ((det0, reqs),)
        else:
            groups = tuple((det, [r for r in reqs if r.deterministic == det]) for det in (False, True))
        for det, group in groups:
            if group:
                try:
                    self._serve(group, det)
                except Exception as exc:  # a bad batch must not kill serving
                    log.exception("inference failed")
                    for r in group:
                        self.reply(r.identity, encode("error", {
                            "code": "inference_failed", "message": f"{type(exc).__name__}: {exc}"}))

    def _rtc_rows(self, group: list[ActRequest]) -> RtcRows:
        """The batch's RTC rows: each request's prefix, delay and pending count; a request
        without RTC gets pending 0 (its rows are served as a plain act)."""
        first = next(r.rtc for r in group if r.rtc)
        h, a = first[RTC_PREFIX].shape[1:]
        n = sum(r.n for r in group)
        prefix, delay, pending = np.zeros((n, h, a), np.float32), np.zeros(n, np.int64), np.zeros(n, np.int64)
        i = 0
        for r in group:
            if r.rtc:
                prefix[i:i + r.n], delay[i:i + r.n] = r.rtc[RTC_PREFIX], r.rtc[RTC_DELAY]
                pending[i:i + r.n] = r.rtc[RTC_PENDING]
            i += r.n
        return RtcRows(prefix, delay, pending, self.rtc)

    def _serve_finite_rows(self, group: list[ActRequest], actions: np.ndarray, deterministic: bool) -> None:
        """Some rows of a batch came out NaN or Inf: their requests get ``inference_failed``,
        the others are served again without them (rows do not mix in a policy's forward)."""
        ok = np.isfinite(actions.reshape(len(actions), -1)).all(axis=1)
        good, i = [], 0
        for r in group:
            if ok[i:i + r.n].all():
                good.append(r)
            else:
                self.reply(r.identity, encode("error", {
                    "code": "inference_failed",
                    "message": "the policy returned non-finite actions (NaN or Inf) for this "
                               f"observation (policy version {self.version})"}))
            i += r.n
        log.error("inference: %d of %d requests got non-finite actions (policy version %d)",
                  len(group) - len(good), len(group), self.version)
        if good and len(good) < len(group):
            self._serve(good, deterministic)

    def _serve(self, group: list[ActRequest], deterministic: bool) -> None:
        t0 = time.perf_counter()
        if len(group) == 1:
            # one request: hand torch its arrays as they are when they own writable, aligned
            # memory (views of the received zero-copy frames, kept alive by the tensors); a
            # read-only or unaligned one (a small frame, bytes) is copied
            from_numpy = torch.from_numpy
            obs = {}
            for k, a in group[0].arrays.items():
                flags = a.flags
                obs[k] = from_numpy(a if flags.writeable and flags.aligned else a.copy())
            tasks = list(group[0].tasks)
        else:
            keys = list(group[0].arrays)
            obs = {k: torch.from_numpy(np.concatenate([r.arrays[k] for r in group])) for k in keys}
            tasks = [t for r in group for t in r.tasks]
        if not self._on_cpu:
            obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        obs[TASK] = tasks
        kw = self._act_kw if self.rtc is None or not any(r.rtc for r in group) else \
            {**self._act_kw, "rtc": self._rtc_rows(group)}
        if self.autocast_dtype is None:
            chunk = self.policy.act(obs, deterministic=deterministic, **kw)
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                chunk = self.policy.act(obs, deterministic=deterministic, **kw)
        a = chunk.actions
        if a.dtype is torch.float32:
            try:  # one torch call for the usual float32 CPU tensor
                actions = a.numpy()
            except TypeError:  # on a GPU
                actions = a.cpu().numpy()
        else:
            actions = a.float().cpu().numpy()
        if not np.isfinite(actions).all():  # never a NaN or Inf action to a robot
            self._serve_finite_rows(group, actions, deterministic)
            return
        if self.extras_spec or chunk.extras or chunk.log_prob is not None:
            extras = extras_to_numpy(chunk.extras_with_log_prob(), self.extras_spec, actions.shape[0])
        else:  # nothing declared, nothing returned
            extras = {}
        infer_ms = (time.perf_counter() - t0) * 1000.0
        self.batches += 1  # (before the replies: whoever has a reply sees its batch counted)
        self.served += len(group)
        self.batch_sizes.append(len(group))
        if len(self.batch_sizes) > 1000:
            del self.batch_sizes[:500]
        self.recent.append((t0, len(group), infer_ms))
        if len(group) == 1:
            r = group[0]
            self.reply(r.identity, encode(
                "act_reply", {"req_id": r.req_id, "policy_version": self.version, "infer_ms": infer_ms,
                              "batch": 1}, {"actions": actions, **extras} if extras else {"actions": actions}))
        else:
            self._reply_rows(group, actions, extras, infer_ms)
        if self.arrivals is not None:
            t = time.perf_counter()
            for r in group:
                self.arrivals.replied(r.identity, t)

    def _reply_rows(self, group: list[ActRequest], actions: np.ndarray, extras: dict, infer_ms: float) -> None:
        """Each request of a batch its rows of ``actions`` and of every extra."""
        i = 0
        for r in group:
            self.reply(r.identity, encode(
                "act_reply",
                {"req_id": r.req_id, "policy_version": self.version, "infer_ms": infer_ms,
                 "batch": len(group)},
                {"actions": actions[i:i + r.n], **{k: v[i:i + r.n] for k, v in extras.items()}},
            ))
            i += r.n
