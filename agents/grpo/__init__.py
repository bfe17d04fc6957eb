"""GRPO: PPO's update on group-relative advantages (``agent``), with the learner's group jobs
and their wiring (``builder``)."""
