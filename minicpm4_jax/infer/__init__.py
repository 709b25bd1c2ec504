"""Inference: the KV cache, sampling and the generation engine (dense and InfLLM v2 sparse)."""

from minicpm4_jax.infer.cache import KVCache, LayerCache, cache_capacity, init_cache
from minicpm4_jax.infer.engine import GenerationOutput, InferenceEngine, check_generation_request
from minicpm4_jax.infer.sampling import SamplingParams, sample_tokens, top_k_filter, top_p_filter

__all__ = [
    "GenerationOutput",
    "InferenceEngine",
    "KVCache",
    "LayerCache",
    "SamplingParams",
    "cache_capacity",
    "check_generation_request",
    "init_cache",
    "sample_tokens",
    "top_k_filter",
    "top_p_filter",
]
