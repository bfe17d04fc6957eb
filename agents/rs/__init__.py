"""Rejection sampling (Hi-ORS): the BC agent and its config (``agent``), the cadence of
collect -> train -> evaluate -> keep or roll back, and the wiring (``builder``)."""
