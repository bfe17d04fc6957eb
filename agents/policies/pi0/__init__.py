"""PI0 and PI0.5: the policy (``policy``), its batched CUDA-graph serving path (``fast``), lerobot's
modules at any size (``lerobot_modules``), the prompt (``prompt``), normalisation (``norm``), Flow-Noise / Flow-SDE for
on-policy RL (``flow_rl``, ``flow_rl_config``) and real-time chunking's guidance (``rtc``)."""
