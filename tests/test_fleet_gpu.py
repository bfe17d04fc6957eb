"""The fleet bench's GPU mode (tools/bench/fleet.py ``--device``, ``--policy pi0``,
``--learner-per load``; tools/bench/fleet_gpu.py) on a CPU: the flags reach the learner's
overrides (the default CPU overrides unchanged), the hardware block and plot title, the GPU
window figures, and one small real run of the full-size PI0's path at test sizes against one
shared learner (about 25 s on the 2-core VM, most of it the learner's start). What needs a GPU
is skipped without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import fleet, fleet_gpu
from tools.bench.fleet_report import limits, plot, verdict

pytestmark = pytest.mark.timeout(240)


def _args(*argv: str):
    args = fleet.parser().parse_args(list(argv))
    args.max_actors = 16
    return args


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def test_default_overrides_are_the_cpu_benchs():
    args = _args()
    assert args.device == "cpu" and args.policy == "tiny-pi0" and args.learner_per == "point"
    o = fleet.learner_overrides("camera", args, Path("/run"), Path("/ck"))
    for x in ("device=cpu", "policy.device=cpu", "policy.checkpoint=/ck", "policy.lora_rank=4", "policy.chunk_size=5",
              "trainer.num_threads=1"):
        assert x in o, x
    assert not any(x.startswith(("policy.fast_", "policy.tokenizer", "+policy.arch")) for x in o)
    assert "device=cpu" in fleet.learner_overrides("state", args, Path("/run"), None)


def test_gpu_flags_reach_the_learner_overrides():
    args = _args("--device", "cuda:0", "--policy", "pi0", "--serve-buckets", "1,2,4,8,16,32,64")
    o = fleet.learner_overrides("camera", args, Path("/run"), Path("/tok"))
    for x in ("device=cuda:0", "policy=pi0", "policy.device=cuda:0", "policy.checkpoint=null",
              "policy.tokenizer=/tok", "policy.fast_compile=false", "policy.fast_warmup_buckets=[1,2,4,8,16,32,64]",
              "policy.chunk_size=5", "algo=rejection_sampling"):
        assert x in o, x
    # full size: no tiny LoRA rank, no reduced architecture
    assert "policy.lora_rank=4" not in o and not any(x.startswith("+policy.arch") for x in o)
    assert "device=cuda:0" in fleet.learner_overrides("state", args, Path("/run"), None)
    tiny = fleet.learner_overrides("camera", _args("--policy", "pi0", "--pi0-arch", "tiny"), Path("/run"), Path("/t"))
    (arch,) = [x for x in tiny if x.startswith("+policy.arch=")]
    assert "width:64" in arch and "vocab_size:512" in arch
    # the robots' config hash is computed from the same overrides
    assert len(fleet.config_hash_of(o)) == 16


def test_learner_per_load_refuses_compare_root():
    with pytest.raises(SystemExit):
        fleet.main(["--learner-per", "load", "--compare-root", "/tmp/x"])


def test_hardware_block_and_title_on_the_cpu():
    hw = fleet_gpu.hardware("cpu")
    assert hw["gpu"] is None and hw["cpus"] >= 1 and hw["note"] == fleet_gpu.CPU_NOTE
    assert fleet_gpu.title({"hardware": hw}) == f"{hw['cpus']}-core VM, no GPU"
    gpu = {"hardware": {"cpus": 16, "gpu": "NVIDIA H200", "learner_device": "cuda"}, "settings": {"policy": "pi0"}}
    t = fleet_gpu.title(gpu)
    assert "16 cores" in t and "NVIDIA H200" in t and "no GPU" not in t


def test_gpu_window_and_its_limit():
    samples = [(0.5, 10.0, 100.0), (1.0, 80.0, 9000.0), (2.0, 100.0, 9500.0), (9.0, 0.0, 20000.0)]
    w = fleet_gpu.gpu_window(samples, 1.0, 2.0)
    assert w == {"util_pct_mean": 90.0, "util_pct_max": 100.0, "mem_used_mib_peak": 9500.0, "samples": 2}
    assert fleet_gpu.gpu_window(samples, 3.0, 4.0) is None
    point = {"cpus": 16, "gpu": w, "cpu_cores": {"learner_threads": {"tandem-inference": 0.4}, "learner_python_threads": 0.5,
                                                 "learner_children": {}, "robots_max_process": 0.3,
                                                 "machine_busy_cores": 4.0}}
    top = limits(point)[0]
    assert top == ("GPU busy (nvidia-smi utilization)", 0.9)
    assert ("one robot process (harness, GIL)", 0.3) in limits(point)


@pytest.mark.skipif(_has_cuda(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu_stops_at_once():
    with pytest.raises(SystemExit, match="no CUDA device"):
        fleet_gpu.hardware("cuda")


@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_hardware_block_names_the_gpu():
    import torch

    hw = fleet_gpu.hardware("cuda")
    assert hw["gpu"] == torch.cuda.get_device_name(0) and hw["learner_device"] == "cuda"
    assert fleet_gpu.gpu_sample("cuda") is not None


def test_full_pi0_path_against_one_shared_learner(tmp_path):
    """--policy pi0 --pi0-arch tiny: the learner builds the PI0 from no checkpoint with the
    bench's tokenizer; two N run against the one learner, new robot names each time."""
    out_json = tmp_path / "fleet.json"
    fleet.main(["--loads", "camera", "--actors", "1,2", "--policy", "pi0", "--pi0-arch", "tiny",
                "--learner-per", "load", "--seconds", "3", "--warmup-s", "1", "--drain-s", "15", "--settle-s", "10",
                "--processes", "1", "--episode-steps", "5", "--work", str(tmp_path / "work"),
                "--spool-dir", str(tmp_path / "spools"), "--learner-override", "buffer.persist=false",
                "--keep-going", "--json", str(out_json)])
    out = json.loads(out_json.read_text())
    assert "failed" not in out, out.get("failed")
    assert out["hardware"]["gpu"] is None and out["settings"]["policy"] == "pi0"
    p1, p2 = out["points"]
    for p in (p1, p2):
        assert p["errors"] == [] and p["act_failures"] == 0 and p["learner_exit"] == 0, p
        assert p["learner_shared"] and p["learner_start_s"] == p1["learner_start_s"]
        assert p["act_ms"]["n"] > 0 and p["acks"]["all_acked"], p["acks"]
        assert p["learner"]["rejected"] == 0 and p["learner"]["duplicates"] == 0
        assert "robots_max_process" in p["cpu_cores"] and "gpu" not in p
        assert p["server_act_p50_ms_median"] is not None  # this N's rows of the learner's table
    assert p2["settled"] is True
    log = (tmp_path / "work" / "camera_all.log").read_text()
    assert "policy=pi0" in log and "config hash" in log
    # what a GPU run adds: the plot's GPU line and title, the verdict's GPU entry
    out["hardware"].update(gpu="Some GPU", learner_device="cuda")
    for p in out["points"]:
        p["gpu"] = {"util_pct_mean": 97.0, "util_pct_max": 100.0, "mem_used_mib_peak": 1.0, "samples": 2}
    plot(out, str(tmp_path / "gpu.png"))
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert ["GPU busy (nvidia-smi utilization)", 0.97] in [list(x) for x in verdict(out["points"])["camera"]
                                                            ["busiest_inside_the_learner"]]
