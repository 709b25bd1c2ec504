"""NNX modules and the pure functions they call (RMSNorm, LongRoPE, attention dispatch)."""

from minicpm4_jax.nn.model import MiniCPM4

__all__ = ["MiniCPM4"]
