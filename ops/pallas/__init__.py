"""Pallas kernels for InfLLM v2 (TPU Mosaic and GPU Triton lowerings), behind a dispatch with the XLA
references as the fallback. Import-light: backend modules are imported by their callers, never here.

* ``sparse_attention.block_sparse_attention``: stage-2 block-sparse flash attention, forward + backward
  (``block_lists`` builds its per-tile lists in XLA; ``sparse_tpu`` / ``sparse_triton`` hold the kernels).
* ``decode.sparse_decode_attention_pallas`` / ``decode.dense_decode_attention_pallas``: block-sparse / dense
  flash-decoding over the KV-head-major cache (``ops.decode_ref`` semantics, ``backend="tpu"|"triton"``).
* ``stage1.stage1_scores_pallas``: InfLLM v2 stage-1 scores summed over each KV group's heads
  (``infllm.select.stage1_scores`` semantics, ``backend="tpu"|"triton"``).
"""
