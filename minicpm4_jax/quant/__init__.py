"""Ternary (BitCPM4) quantization: the absmean quantizer and its STE (``ternary``), and its use on a
MiniCPM4 parameter tree (``params``). Paper §3.3; spec ``export.md`` §5."""

from minicpm4_jax.quant.params import (
    TERNARY_TABLE,
    PackedTernary,
    TernarySpec,
    checkpoint_is_ternary,
    fake_quant_params,
    layout_of,
    pack_params,
    ternarize,
    ternary_hf_names,
    ternary_paths,
    ternary_spec,
    ternary_stats,
    unpack_params,
)
from minicpm4_jax.quant.ternary import (
    EPS,
    GRANULARITIES,
    STE_MODES,
    MatrixLayout,
    dequantize,
    fake_quant,
    fake_quant_ste,
    first_non_ternary_group,
    numpy_ternary,
    pack_codes,
    recover_codes,
    ternary_codes,
    unpack_codes,
)

__all__ = [
    "TERNARY_TABLE", "PackedTernary", "TernarySpec", "checkpoint_is_ternary", "fake_quant_params",
    "layout_of", "pack_params", "ternarize", "ternary_hf_names", "ternary_paths", "ternary_spec", "ternary_stats", "unpack_params",
    "EPS", "GRANULARITIES", "STE_MODES", "MatrixLayout", "dequantize", "fake_quant", "fake_quant_ste",
    "first_non_ternary_group", "numpy_ternary", "pack_codes", "recover_codes", "ternary_codes", "unpack_codes",
]
