"""SAC and its VLA variants: plain SAC (``agent``, ``builder``, its sharded engines in
:mod:`agents.parallel.sac_engines`, the off-policy cadence in ``off_policy``), noise-space SAC (``noise*``: the actor
picks the flow policy's initial noise) and residual SAC (``residual*``: a residual on the base
policy's action)."""
