"""InfLLM v2 block selection (spec ``minicpm4_model.md`` §5): compressed keys, stage-1 scores,
block pooling, top-k. Pure array functions; stage 2 and the full attention entry live in
``minicpm4_jax.ops.infllm_ref``.
"""

from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys, num_kernels
from minicpm4_jax.infllm.select import (
    SENTINEL,
    SelectParams,
    Selection,
    pool_block_scores,
    select_blocks,
    select_blocks_compressed,
    select_params,
    selection_block_mask,
    selection_scores,
    stage1_scores,
    topk_blocks,
    visible_kernel_count,
)

__all__ = [
    "SENTINEL",
    "SelectParams",
    "Selection",
    "coarse_geometry",
    "compress_keys",
    "num_kernels",
    "pool_block_scores",
    "select_blocks",
    "select_blocks_compressed",
    "select_params",
    "selection_block_mask",
    "selection_scores",
    "stage1_scores",
    "topk_blocks",
    "visible_kernel_count",
]
