"""SAC with action chunks (Q-chunking) through the real learner and actor on the pendulum:
the actor executes 4-step chunks, the replay samples 4-step windows, the critic scores
whole chunks, and the policy improves on a random one."""

from __future__ import annotations

import pytest

from test_integration import Run

pytestmark = pytest.mark.slow


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop_all()


def test_sac_with_chunk_size_4_trains_on_the_pendulum(run):
    chunk = ["env=inverted_pendulum", "policy.chunk_size=4"]
    learner = run.learner(*chunk, "algo.batch_size=128", "algo.learning_starts=300",
                          "algo.publish_every=10", "trainer.max_updates=1500",
                          "trainer.stop_at_success=0.5", "trainer.stop_min_episodes=20")
    run.actor("a0", *chunk, "seed=1")
    run.wait(lambda: learner.poll() is not None, 280, "the learner to finish")
    assert learner.returncode == 0, learner.log.read_text()[-3000:]
    st = run.status()
    text = learner.log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert st["updates"] >= 200, st
    assert st["version"] >= 10
    # a random policy never keeps the pole up for 100 steps; the chunked one does by the end
    print(f"\nchunked SAC: {st['updates']} updates, success {st.get('success')}, "
          f"return {st.get('return')}")
    assert st["success"] >= 0.3, st
