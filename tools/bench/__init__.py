"""Tandem's benchmarks, sharing one set of fixtures (:mod:`tools.bench.common`).

Entry points (thin modules in ``tools/``)::

    python -m tools.bench_transport   # act and ingest paths against raw pyzmq (tools.bench.transport)
    python -m tools.bench_buffer      # replay buffer against lerobot's (tools.bench.buffer)
    python -m tools.bench_policy      # VLA policies behind the learner socket (tools.bench.policy)
"""
