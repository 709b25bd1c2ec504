"""MiniCPM / MiniCPM4 configuration for ``AutoConfig.from_pretrained(..., trust_remote_code=True)``.

Written by minicpm4-jax for its official-layout exports (``model_type: minicpm``, which transformers does not
know natively): CPM.cu and other loaders that call ``AutoConfig`` read this class; the fields are those of the
released ``config.json`` (spec ``export.md`` §1.2), stored as given. Works with transformers 4.46+ and 5.x.
"""

from transformers import PretrainedConfig


class MiniCPMConfig(PretrainedConfig):
    """A MiniCPM4 model: Llama-style decoder with μP scalars (``scale_emb``, ``scale_depth``, ``dim_model_base``),
    LongRoPE ``rope_scaling`` and an optional InfLLM v2 ``sparse_config`` (kept as a dict)."""

    model_type = "minicpm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=73448,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rope_scaling=None,
        attention_bias=False,
        attention_dropout=0.0,
        scale_emb=1.0,
        dim_model_base=1,
        scale_depth=1.0,
        sparse_config=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if isinstance(getattr(type(self), "rope_scaling", None), property):
            self.rope_parameters = rope_scaling  # transformers 5 keeps rope_scaling as an alias of rope_parameters
        else:
            self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.scale_emb = scale_emb
        self.dim_model_base = dim_model_base
        self.scale_depth = scale_depth
        self.sparse_config = sparse_config
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def to_dict(self):
        """The config as saved: transformers 5 keeps LongRoPE as ``rope_parameters``; ``rope_scaling`` (the released
        key, which CPM.cu, llama.cpp's converter and minicpm4-jax's ``import hf`` read) is written beside it."""
        out = super().to_dict()
        rp = out.get("rope_parameters")
        if out.get("rope_scaling") is None and isinstance(rp, dict) and rp.get("rope_type") == "longrope":
            out["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        return out
