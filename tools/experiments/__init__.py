"""Learning experiments (not shipped in the wheel): runs through the real learner and actor
processes on loopback that show an algorithm learning, and the pre-registered point_reach_vl
runs. They share one harness, :mod:`tools.experiments.learning_run`; results are in
docs/learning.md and docs/preregistered.md."""
