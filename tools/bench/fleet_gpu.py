"""The fleet bench's GPU mode (:mod:`tools.bench.fleet` ``--device cuda``): the hardware block
(the GPU's name from ``torch.cuda.get_device_name``, asked in a child process so that the bench
itself holds no CUDA context on the learner's GPU), the GPU's busy share and memory read once a
second from ``nvidia-smi``, and the learner overrides of a full-size PI0 built from scratch
(``--policy pi0``).

The full-size PI0 is built the way :func:`tools.bench.policy.build` (which ``train_serve``,
``cold_start`` and ``pi0_fast`` use) builds it: no checkpoint (``policy.checkpoint=null``: the
learner builds lerobot's standard PI0 with random weights drawn from ``policy.seed``, both of its
copies alike, directly on the device) and a small Gemma-style tokenizer from
:func:`tools.make_tiny_checkpoints.build_tokenizer`. Nothing is downloaded and nothing of the
model is written to disk. Serving runs the fast path's CUDA graphs without ``torch.compile``
(``policy.fast_compile=false``: a cold compile costs minutes) over every batch bucket the fleet
can produce (up to ``inference.max_batch``, 64), captured before the service starts.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

#: the fast path's batch buckets (agents/policies/pi0/fast.py DEFAULT_BUCKETS) up to
#: inference.max_batch: the learner's warm-up captures each before serving
SERVE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

CPU_NOTE = "2-core VM shared with other work, no GPU; the simulated robots run on the same cores as the learner"


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def gpu_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cuda_device(device: str, timeout_s: float = 120.0) -> dict:
    """{"name", "memory_gib", "torch"} of ``device`` from a child process (torch.cuda); raises
    SystemExit with the child's error when there is no such device."""
    code = ("import json, torch\n"
            "assert torch.cuda.is_available(), 'torch sees no CUDA device'\n"
            f"i = {gpu_index(device)}\n"
            "p = torch.cuda.get_device_properties(i)\n"
            "print(json.dumps({'name': torch.cuda.get_device_name(i), 'memory_gib': round(p.total_memory / 2**30, 1),"
            " 'torch': torch.__version__}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit(f"--device {device}: no CUDA device ({r.stderr.strip().splitlines()[-1:] or r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def hardware(device: str) -> dict:
    """The JSON's hardware block. On the CPU it is the block the bench always wrote."""
    base = {"cpus": os.cpu_count(), "gpu": None, "machine": platform.machine(), "kernel": platform.release()}
    if not is_cuda(device):
        return {**base, "note": CPU_NOTE}
    gpu = cuda_device(device)
    return {**base, "gpu": gpu["name"], "gpu_memory_gib": gpu["memory_gib"], "torch": gpu["torch"],
            "learner_device": device, "cpu_model": cpu_model(),
            "note": f"{os.cpu_count()} cores shared by the learner and the simulated robots (niced); the "
                    f"learner's policy on the GPU ({gpu['name']})"}


def title(out: dict) -> str:
    """The plot's hardware words: the CPU count, and the GPU's name where the learner had one."""
    hw = out["hardware"]
    if not hw.get("gpu"):
        return f"{hw['cpus']}-core VM, no GPU"
    policy = out.get("settings", {}).get("policy")
    return f"{hw['cpus']} cores + {hw['gpu']} (learner on {hw.get('learner_device', 'cuda')}, camera policy {policy})"


def gpu_sample(device: str) -> tuple[float, float] | None:
    """(utilization %, memory used MiB) of the learner's GPU now (nvidia-smi), None if unreadable."""
    if shutil.which("nvidia-smi") is None:
        return None
    idx = str(gpu_index(device))
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:  # torch's index counts the visible devices only
        idx = visible[int(idx)] if int(idx) < len(visible) else idx
    try:
        out = subprocess.run(["nvidia-smi", f"--id={idx}", "--query-gpu=utilization.gpu,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        util, mem = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
    except Exception:  # noqa: BLE001 - a missing figure, not a failed run
        return None
    return util, mem


def gpu_window(samples: list[tuple[float, float, float]], t0: float, t1: float) -> dict | None:
    """The GPU's figures between monotonic times ``t0`` and ``t1`` from ``(t, util %, MiB)``
    samples: mean and max utilization (the share of time a kernel ran) and peak memory used."""
    inside = [(u, m) for t, u, m in samples if t0 <= t <= t1]
    if not inside:
        return None
    util = [u for u, _ in inside]
    return {"util_pct_mean": round(sum(util) / len(util), 1), "util_pct_max": max(util),
            "mem_used_mib_peak": max(m for _, m in inside), "samples": len(inside)}


def full_pi0_tokenizer(work: Path) -> Path:
    """The tokenizer folder of the full-size PI0 (tools.bench.policy.build's)."""
    from tools.make_tiny_checkpoints import build_tokenizer

    tok = work / "pi0_full_tokenizer"
    if not (tok / "tokenizer.json").exists():
        build_tokenizer(tok, kind="gemma")
    return tok


def full_pi0_overrides(tokenizer: Path, buckets: list[int]) -> list[str]:
    """The learner's policy overrides of a full-size PI0 from scratch, graphs without compile."""
    return ["policy.checkpoint=null", f"policy.tokenizer={tokenizer}", "policy.fast_compile=false",
            "policy.fast_warmup_buckets=[" + ",".join(str(b) for b in buckets) + "]"]
