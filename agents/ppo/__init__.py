"""PPO over action chunks: the agent (``agent``), its losses (``losses``), the round cadence
and rollout batching shared with GRPO (``on_policy``) and the wiring (``builder``)."""
