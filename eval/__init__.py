"""Evaluation (``minicpm4_jax.eval``): filled by the evaluation issue."""
