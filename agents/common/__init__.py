"""What several algorithms share: encoders, critics, value heads, advantage estimators, KL
penalties and batched policy calls."""
