"""The wire protocol both boxes import: schema + codec, EnvSpec and config hash, transition
batches, weight snapshots, jobs, CURVE security and the wire gate that owns a server's ports.
No torch models, simulators or gymnasium; the layers above it: ``tests/test_layers.py``."""
