"""learner/warmup.py through the real InferenceServer thread: a staged warm-up serves after the
smallest bucket, caps batches at the largest bucket warmed, and warms the rest between batches;
``all`` warms every bucket first. The policy here stands in for a GPU fast path (which captures
nothing on a CPU): its warm_up records which buckets it was asked for and its act records the
rows of each batch and which buckets were warm then."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from agents.base import ActionChunk
from learner.act_intake import ActRequest
from learner.inference import InferenceServer
from learner.warmup import Warmup


class Bucketed:
    chunk_size = 2

    def __init__(self, buckets=(1, 2, 4, 8), warm_s: float = 0.05):
        self.cfg = SimpleNamespace(fast_warmup_buckets=buckets)
        self.warm_s, self.asked, self.warm, self.batches = warm_s, [], set(), []

    def warm_up(self, batch_sizes=None, *, max_batch=None):
        sizes = [b for b in (batch_sizes or self.cfg.fast_warmup_buckets) if max_batch is None or b <= max_batch]
        self.asked.append(list(batch_sizes) if batch_sizes is not None else None)
        time.sleep(self.warm_s)  # a compile
        self.warm.update(sizes)
        return {b: self.warm_s for b in sizes}

    def act(self, obs, *, deterministic=False):
        n = obs["observation.state"].shape[0]
        self.batches.append((n, max(self.warm, default=0)))
        time.sleep(0.01)
        return ActionChunk(torch.zeros(n, self.chunk_size, 2))


def request(i: int) -> ActRequest:
    return ActRequest(identity=b"actor-%d" % i, req_id=1, deterministic=True, tasks=["t"],
                      arrays={"observation.state": np.zeros((1, 3), np.float32)})


def until(cond, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.005)


def server(policy, mode="staged", max_batch=8, replies=None):
    return InferenceServer(policy, reply=lambda ident, frames: replies.append(ident) if replies is not None else None,
                           active_actors=lambda: 8, device=torch.device("cpu"), max_batch=max_batch,
                           batch_window_ms=50.0, warmup=mode)


def test_staged_serves_after_the_smallest_bucket_and_never_gathers_past_the_warm_ones():
    policy, replies = Bucketed(warm_s=0.3), []
    inf = server(policy, replies=replies)
    assert policy.asked == [[1]] and inf.warmup_s == {1: 0.3} and inf.warmup.cap == 1 and inf.warmup.pending
    assert inf.warmup.stats() == {"mode": "staged", "buckets_s": {"1": 0.3}, "to_warm": [2, 4, 8], "cap": 1,
                                  "total_s": None}
    inf.start()
    try:
        for round_ in range(6):  # 8 actors at once, each waits for its reply, six times
            n0 = len(replies)
            for i in range(8):
                inf.submit(request(i))
            until(lambda: len(replies) >= n0 + 8, 20)
            assert len(replies) == n0 + 8, f"round {round_}: {len(replies) - n0} of 8 replies"
        until(lambda: not inf.warmup.pending, 5)
    finally:
        inf.stop()
        inf.join(5)
    assert policy.asked == [[1], [2], [4], [8]]  # one bucket at a time, smallest first
    assert all(rows <= warm for rows, warm in policy.batches), policy.batches
    assert max(rows for rows, _ in policy.batches) == 8  # full batches once every bucket is warm
    assert inf.warmup.cap == 8 and not inf.warmup.pending and inf.warmup.total_s >= 4 * 0.3
    assert sorted(inf.warmup_s) == [1, 2, 4, 8]
    st = inf.warmup.stats()
    assert st["to_warm"] == [] and st["cap"] == 8 and list(st["buckets_s"]) == ["1", "2", "4", "8"]


def test_a_server_kept_busy_by_fewer_actors_than_it_knows_still_warms_the_next_buckets():
    """Closed loop: one actor asks again 2 ms after each reply, so the queue is empty when a
    batch ends and the server is never idle for its 0.1-s poll; with two active actors and the
    cap at 1 batches are being cut by the cap, and the next buckets are warmed between them (the
    other actors' requests may be waiting on the act socket, outside the queue)."""
    import threading

    policy, got = Bucketed(), threading.Event()
    inf = InferenceServer(policy, reply=lambda ident, frames: got.set(), active_actors=lambda: 2,
                          device=torch.device("cpu"), max_batch=8, batch_window_ms=0.0)
    assert inf.warmup.cap == 1
    stop = threading.Event()

    def actor():
        i = 0
        while not stop.is_set():
            got.clear()
            i += 1
            inf.submit(ActRequest(identity=b"actor-0", req_id=i, deterministic=True, tasks=["t"],
                                  arrays={"observation.state": np.zeros((1, 3), np.float32)}))
            got.wait(5)
            time.sleep(0.002)

    inf.start()
    th = threading.Thread(target=actor, daemon=True)
    th.start()
    try:
        until(lambda: not inf.warmup.pending, 10)
    finally:
        stop.set()
        th.join(5)
        inf.stop()
        inf.join(5)
    assert policy.asked == [[1], [2], [4], [8]] and not inf.warmup.pending
    assert len(policy.batches) >= 4  # it served all along


def test_an_idle_server_warms_the_rest_without_any_request():
    policy = Bucketed()
    inf = server(policy)
    inf.start()
    try:
        until(lambda: not inf.warmup.pending, 5)
    finally:
        inf.stop()
        inf.join(5)
    assert policy.asked == [[1], [2], [4], [8]] and policy.batches == []


def test_all_warms_every_bucket_up_to_max_batch_before_serving():
    policy = Bucketed()
    inf = server(policy, mode="all", max_batch=4)
    assert policy.asked == [None] and sorted(inf.warmup_s) == [1, 2, 4] and inf.warmup.cap == 4
    staged = server(Bucketed(), max_batch=4)
    assert staged.warmup.todo == [2, 4]  # the 8 bucket is past max_batch


def test_policies_that_cannot_stage_are_warmed_at_once_and_nothing_to_warm_caps_nothing():
    class Old:  # a warm_up without batch_sizes
        def __init__(self):
            self.calls = 0

        def warm_up(self, *, max_batch):
            self.calls += 1
            return {1: 0.0, 2: 0.0}

    old = Old()
    w = Warmup(old, device=torch.device("cpu"), max_batch=8)
    assert w.mode == "all" and w.start() == {1: 0.0, 2: 0.0} and old.calls == 1 and w.cap == 8

    class NoGraphs(Bucketed):  # a fast path on a CPU: it captures nothing
        def warm_up(self, batch_sizes=None, *, max_batch=None):
            self.asked.append(batch_sizes)
            return {}

    p = NoGraphs()
    w = Warmup(p, device=torch.device("cpu"), max_batch=8)
    assert w.start() == {} and p.asked == [[1]] and not w.pending and w.cap == 8


def test_a_failed_stage_ends_the_staging_and_serving_goes_on():
    class Fails(Bucketed):
        def warm_up(self, batch_sizes=None, *, max_batch=None):
            if batch_sizes == [2]:
                raise RuntimeError("out of memory while capturing")
            return super().warm_up(batch_sizes, max_batch=max_batch)

    w = Warmup(Fails(), device=torch.device("cpu"), max_batch=8)
    w.start()
    assert w.cap == 1
    w.next()
    assert not w.pending and w.cap == 8 and w.buckets == {1: 0.05}


def test_a_bad_mode_is_named():
    with pytest.raises(ValueError, match="inference.warmup must be one of all, staged, got 'lazy'"):
        Warmup(Bucketed(), device=torch.device("cpu"), max_batch=8, mode="lazy")


def test_the_tiny_pi0_on_a_cpu_has_nothing_to_stage(tmp_path):
    from agents import registry
    from data.core.spec import EnvSpec
    from tools.make_tiny_checkpoints import make_pi0

    spec = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
    policy = registry.build_policy({"name": "pi0", "checkpoint": str(make_pi0(tmp_path / "pi0", spec, chunk_size=4)),
                                    "chunk_size": 4, "device": "cpu"}, spec).eval()
    inf = server(policy)
    assert inf.warmup_s == {} and not inf.warmup.pending and inf.warmup.cap == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_tiny_pi0_serves_after_bucket_1_and_warms_the_rest_on_the_serving_thread(tmp_path):
    """The real fast path (compiled, CUDA graphs): the server is built with bucket 1 captured,
    its idle thread captures 2, 4 and 8 under its own stream and inference mode, and a batch of 4
    requests then replays a warm graph (no capture, no compile while serving)."""
    from agents import registry
    from agents.policies.fast_common import compiled_graphs
    from data.core.spec import EnvSpec
    from tools.make_tiny_checkpoints import make_pi0

    spec = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
    policy = registry.build_policy({"name": "pi0", "checkpoint": str(make_pi0(tmp_path / "pi0", spec, chunk_size=4)),
                                    "chunk_size": 4, "device": "cuda", "dtype": "bfloat16"}, spec).eval()
    replies: list = []
    inf = InferenceServer(policy, reply=lambda ident, frames: replies.append(ident), active_actors=lambda: 4,
                          device=torch.device("cuda"), max_batch=8, batch_window_ms=200.0)
    assert sorted(inf.warmup_s) == [1] and inf.warmup.cap == 1
    fast = policy._fast
    inf.start()
    try:
        until(lambda: not inf.warmup.pending, 600)
        assert sorted(inf.warmup_s) == [1, 2, 4, 8] and inf.warmup.cap == 8
        captures, compiled = fast.captures, compiled_graphs()
        for i in range(4):
            inf.submit(ActRequest(identity=b"a%d" % i, req_id=1, deterministic=True, tasks=["reach"],
                                  arrays={"observation.state": np.zeros((1, 4), np.float32),
                                          "observation.images.image": np.zeros((1, 32, 32, 3), np.uint8)}))
        until(lambda: len(replies) >= 4, 60)
    finally:
        inf.stop()
        inf.join(10)
    assert len(replies) == 4 and 4 in inf.batch_sizes
    assert fast.captures == captures and compiled_graphs() == compiled


def test_the_artefacts_folder_holds_the_ahead_of_time_functions_of_a_policy_that_has_them(tmp_path):
    from test_oft_fast import SPEC, make
    from tools.make_tiny_checkpoints import make_openvla_oft

    ck = make_openvla_oft(tmp_path / "oft", SPEC, chunk_size=4)
    folder = tmp_path / "ship"
    oft = make(ck, "l1", device="cpu")
    Warmup(oft, device=torch.device("cpu"), max_batch=2, compile_artifacts=str(folder)).start()
    assert oft.cfg.fast_aot_dir == str(folder / "aot")
    mine = make(ck, "l1", device="cpu", fast_aot_dir=str(tmp_path / "mine"))   # its own folder stays
    Warmup(mine, device=torch.device("cpu"), max_batch=2, compile_artifacts=str(folder)).start()
    assert mine.cfg.fast_aot_dir == str(tmp_path / "mine")
    other = Bucketed()                                                       # no such setting: untouched
    Warmup(other, device=torch.device("cpu"), max_batch=2, compile_artifacts=str(folder)).start()
    assert not hasattr(other.cfg, "fast_aot_dir")


LIBERO_TASK = "pick up the black bowl between the plate and the ramekin and place it on the plate"


def test_the_pi0_warm_up_acts_once_per_prompt_width_up_to_its_limit(tmp_path):
    """PI0 pads a batch's prompts to its longest, rounded up to ``prompt_pad_multiple``: the
    warm-up's tasks are one per width, widest last, and a long instruction's width is one of them."""
    from agents import registry
    from data.core.spec import EnvSpec
    from tools.make_tiny_checkpoints import make_pi0

    spec = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
    ck = make_pi0(tmp_path / "pi0", spec, chunk_size=4)
    policy = registry.build_policy({"name": "pi0", "checkpoint": str(ck), "chunk_size": 4, "device": "cpu",
                                    "prompt_pad_multiple": 8, "fast_warmup_prompt_tokens": 64}, spec).eval()
    from agents.policies.pi0.prompt import prompts

    def width(task):
        return policy.prompt_tokens(prompts("pi0", [task], torch.zeros(1, 4)), torch.device("cpu"))[0].shape[1]

    tasks = policy.warm_up_tasks()
    widths = [width(t) for t in tasks]
    assert tasks[0] == "warm up" and widths == sorted(set(widths)) and len(widths) >= 2
    assert widths[-1] == min(64, policy.prompt_tokens.max_len)
    assert all(w % 8 == 0 or w == policy.prompt_tokens.max_len for w in widths)
    assert width(LIBERO_TASK) in widths
    policy.cfg.fast_warmup_prompt_tokens = 0
    assert policy.warm_up_tasks() == ["warm up"]


def test_the_oft_warm_up_acts_once_per_token_row_width_up_to_its_limit(tmp_path):
    from test_oft_fast import SPEC, make
    from tools.make_tiny_checkpoints import make_openvla_oft

    p = make(make_openvla_oft(tmp_path / "oft", SPEC, chunk_size=4), "discrete", fast_serving="eager", device="cpu")
    torch.set_grad_enabled(False)  # (as in warm_up: no fast path with gradients on)
    try:
        _check_oft_widths(p)
    finally:
        torch.set_grad_enabled(True)


def _check_oft_widths(p):
    from agents.policies.openvla_oft.fast import warm_up_tasks

    fast = p.fast_path()
    proprio = p.proprio_projector is not None

    def width(task):
        return fast.ids_width(int(p._token_rows([task])[0].shape[1]), proprio)

    tasks = warm_up_tasks(p)
    widths = [width(t) for t in tasks]
    assert tasks[0] == "warm up" and widths == sorted(set(widths)) and len(widths) >= 2
    assert width(LIBERO_TASK) in widths  # (a 64-token limit covers LIBERO's instructions)
    assert widths[-1] <= fast.ids_width(64 + p.k + 1, proprio)
    p.cfg.fast_warmup_prompt_tokens = 0
    assert warm_up_tasks(p) == ["warm up"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_long_instruction_after_the_warm_up_replays_a_graph_it_captured(tmp_path):
    from agents import registry
    from data.core.spec import EnvSpec
    from tools.make_tiny_checkpoints import make_pi0

    spec = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
    policy = registry.build_policy({"name": "pi0", "checkpoint": str(make_pi0(tmp_path / "pi0", spec, chunk_size=4)),
                                    "chunk_size": 4, "device": "cuda", "dtype": "bfloat16",
                                    "prompt_pad_multiple": 8}, spec).eval()
    policy.warm_up([1, 2])
    fast, captures = policy._fast, policy._fast.captures
    with torch.no_grad():
        for b in (1, 2):
            policy.act({"observation.state": torch.zeros(b, 4, device="cuda"), "task": [LIBERO_TASK] * b,
                        "observation.images.image": torch.zeros(b, 32, 32, 3, dtype=torch.uint8, device="cuda")},
                       deterministic=True)
    assert fast.captures == captures
