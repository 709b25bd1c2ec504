"""Attention kernels and their pure-XLA references (installed as ``minicpm4_jax.ops``).

This package knows arrays and configs only, never the model.
"""
