"""Training: optimizer and schedules, data pipeline, train step, checkpoints, the loop (``minicpm4_jax.train``)."""
