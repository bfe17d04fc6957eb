"""The transport bench's server (learner) side, in the driver's process: a zero-action policy
behind a loopback learner that records stage timestamps, and the CPU meter over both
processes' threads."""

from __future__ import annotations

from data.core.schema import OBS_STATE
from data.core.spec import EnvSpec
from tools.bench.common import LoopbackLearner, perf
from tools.bench.procstat import cpu_delta, thread_cpu


class ZeroPolicy:
    """Returns zero action chunks at once; records when each act() started."""

    capabilities = frozenset()

    def __init__(self, chunk: int, action_dim: int):
        import torch

        from agents.base import ActionChunk

        self.torch = torch
        self.chunk_cls = ActionChunk
        self._zeros: dict[int, object] = {}
        self.chunk_size = chunk
        self.action_dim = action_dim
        self.t_act: list[float] = []

    def act(self, obs, *, deterministic: bool = False):
        self.t_act.append(perf())
        b = obs[OBS_STATE].shape[0]
        zeros = self._zeros.get(b)
        if zeros is None:  # the same (never written) zeros for every batch of b
            zeros = self._zeros[b] = self.torch.zeros(b, self.chunk_size, self.action_dim)
        return self.chunk_cls(zeros)

    def trainable_state_dict(self):
        return {}

    def load_trainable_state_dict(self, state) -> None:
        pass


class TandemStack(LoopbackLearner):
    """A started :class:`LoopbackLearner` serving :class:`ZeroPolicy` on the CPU; the only
    additions to the product path are list appends recording when the service handed each
    act request on (``t_recv``) and when the inference thread replied (``t_reply``)."""

    def __init__(self, spec: EnvSpec, chash: str, cfg: dict, buffer_capacity: int):
        import torch

        self.t_recv: list[float] = []
        self.t_reply: list[float] = []
        super().__init__(ZeroPolicy(cfg["chunk"], cfg["action_dim"]), spec, chash,
                         buffer_capacity=buffer_capacity, device=torch.device("cpu"))
        self.start()

    def _submit(self, req) -> None:
        self.t_recv.append(req.t_recv)
        self.inference.submit(req)

    def _reply(self, identity: bytes, frames: list) -> None:
        self.t_reply.append(perf())
        self.service.reply(identity, frames)

    def clear_marks(self) -> None:
        self.t_recv.clear()
        self.t_reply.clear()
        self.policy.t_act.clear()


# ---- CPU accounting --------------------------------------------------------------------------

SERVER_LABELS: dict[int, str] = {}  # native thread id -> label, filled by the driver


class Meter:
    """CPU time, per thread and in total, of both processes between start and stop."""

    def __init__(self, worker):
        self.worker = worker
        self.th0 = self._now()

    def _now(self) -> dict[str, float]:
        return {**thread_cpu(SERVER_LABELS), **self.worker.client_threads()}

    def stop(self) -> tuple[float, dict[str, float]]:
        delta = cpu_delta(self.th0, self._now())
        delta.pop("server-main", None)  # the bench's own driver thread (reads /proc, waits)
        return sum(delta.values()), delta


def add_threads(acc: dict[str, float], delta: dict[str, float]) -> None:
    for k, v in delta.items():
        acc[k] = acc.get(k, 0.0) + v


def per_unit(acc: dict[str, float], units: float, scale: float) -> dict[str, float]:
    """CPU per unit by thread, largest first, leaving out threads under 2% of the total."""
    total = sum(acc.values()) or 1.0
    return {k: v * scale / units for k, v in sorted(acc.items(), key=lambda kv: -kv[1]) if v >= 0.02 * total}
