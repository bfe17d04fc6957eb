"""Tandem's core: what the actor box and the learner box both import.

No torch models, no simulators, no gymnasium: the wire schema and codec
(:mod:`data.core.schema`, :mod:`data.core.codec`), the gym-free :class:`data.core.spec.EnvSpec`
and config hash, transport security (:mod:`data.core.security`), the weight-snapshot wire
format (:mod:`data.core.weights`) and episode jobs (:mod:`data.core.jobs`).

Layers, bottom to top (``tests/test_layers.py`` enforces them)::

    data.core  <-  data (replay, store)  <-  envs, agents  <-  learner, actor  <-  tools
"""
