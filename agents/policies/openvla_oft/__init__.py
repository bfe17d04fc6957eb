"""OpenVLA-OFT: the policy with its L1 action head (``policy``), its batched serving path
(``fast``), the discrete-token variant for GRPO / PPO (``discrete``), training from scratch
(``scratch``) and the Prismatic backbone (``prismatic``)."""
