"""minicpm4-jax: MiniCPM4 (arXiv 2506.07900) in JAX / Flax NNX."""

__version__ = "0.1.0"
