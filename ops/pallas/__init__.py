"""Pallas kernels for InfLLM v2 (TPU Mosaic and GPU Triton lowerings), behind a dispatch with the XLA
references as the fallback. Import-light: backend modules are imported by their callers, never here.

* ``sparse_attention.block_sparse_attention``: stage-2 block-sparse flash attention, forward + backward
  (``block_lists`` builds its per-tile lists in XLA; ``sparse_tpu`` / ``sparse_triton`` hold the kernels).
"""
