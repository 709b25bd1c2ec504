"""Checkpoint interchange between this project's NNX parameters and other runtimes' layouts.

* ``llama_fold``: the μP-folded ``LlamaForCausalLM`` layout and the one name table (``LLAMA_PARAM_MAP``).
* ``official``: the official ``MiniCPMForCausalLM`` layout (same names, unfolded; shapes, config).
* ``hf_import`` / ``hf_export``: ``minicpm4 import hf`` and ``minicpm4 export hf --layout minicpm|llama``.
* ``gguf_export``: ``minicpm4 export gguf`` (llama.cpp ``minicpm`` architecture, F32/F16/BF16/Q8_0).
* ``eagle``: ``minicpm4 export eagle`` / ``import hf --eagle`` (the MTP module as an EAGLE-1 draft folder).
* ``io``: atomic output folders, disk-space checks, manifests, (sharded) safetensors.
"""

from minicpm4_jax.convert.llama_fold import (
    LLAMA_PARAM_MAP,
    ParamMap,
    flat_params,
    fold_to_llama,
    hf_param_shapes,
    llama_config,
    unfold_from_llama,
)
from minicpm4_jax.convert.official import (
    from_official,
    iter_official_tensors,
    official_config,
    official_param_shapes,
    to_official,
)

__all__ = [
    "LLAMA_PARAM_MAP",
    "ParamMap",
    "flat_params",
    "fold_to_llama",
    "hf_param_shapes",
    "llama_config",
    "unfold_from_llama",
    "from_official",
    "iter_official_tensors",
    "official_config",
    "official_param_shapes",
    "to_official",
]
