"""Weight-layout conversion between this project's NNX parameters and other runtimes' layouts."""

from minicpm4_jax.convert.llama_fold import (
    LLAMA_PARAM_MAP,
    ParamMap,
    flat_params,
    fold_to_llama,
    hf_param_shapes,
    llama_config,
    unfold_from_llama,
)

__all__ = [
    "LLAMA_PARAM_MAP",
    "ParamMap",
    "flat_params",
    "fold_to_llama",
    "hf_param_shapes",
    "llama_config",
    "unfold_from_llama",
]
