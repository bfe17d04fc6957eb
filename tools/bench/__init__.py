"""Tandem's benchmarks, robustness runs and measurements (not shipped in the wheel). The benches
share one set of fixtures (:mod:`tools.bench.common`). Entry points, run from the repository root::

    python -m tools.bench.transport     # act and ingest paths against raw pyzmq
    python -m tools.bench.buffer        # replay buffer against lerobot's
    python -m tools.bench.policy        # VLA policies behind the learner socket
    python -m tools.bench.train         # one update step per algorithm x policy
    python -m tools.bench.scaling_cli   # 1 vs 2 GPUs (DDP, ZeRO-2, ZeRO-3); --matrix for the table
    python -m tools.bench.fleet         # many actors against one learner
    python -m tools.bench.e2e_run       # a learner and N actors on loopback, measured from outside
    python -m tools.bench.compare_lerobot   # the same run through Tandem and through LeRobot
    python -m tools.bench.rtc_measure   # chunk-boundary jumps with and without real-time chunking
    python -m tools.bench.soak          # does anything grow that should stay flat (memtrace: where)
    python -m tools.bench.fuzz_wire     # the learner's wire under crafted traffic (fuzz_live: live)

:mod:`tools.bench.netproxy` breaks a loopback link on purpose (the fault tests, rtc_measure).
"""
