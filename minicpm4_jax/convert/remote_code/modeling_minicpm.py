"""MiniCPM / MiniCPM4 decoder for ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``.

Written by minicpm4-jax for its official-layout exports (``model_type: minicpm``; transformers has no native
MiniCPM4). It runs the released architecture from the folder's own ``config.json`` on its unfolded weights, with
the semantics of spec ``export.md`` §1.2 (remote-code semantics):

* ``inputs_embeds = embed_tokens(ids) * scale_emb``;
* ``h = h + attn(norm(h)) * scale_depth / sqrt(num_hidden_layers)``, the same for the MLP (SwiGLU);
* ``logits = lm_head(h / (hidden_size / dim_model_base))`` (``lm_head`` is ``embed_tokens`` when tied);
* LongRoPE: ``freqs = outer(t, 1 / ext) * inv_freq`` with ``ext = long_factor`` when ``max_position_embeddings >
  original_max_position_embeddings`` (the list is chosen once, from the configured lengths) else ``short_factor``,
  cos / sin scaled by ``sqrt(1 + ln(max / orig) / ln(orig))`` above the original length, rotate-half layout;
* grouped-query attention, causal, softmax in float32.

Attention is always **dense**: a ``sparse_config`` (InfLLM v2) is kept in the config for runtimes with the sparse
kernels (CPM.cu) and a warning says that this file attends every token (the same outputs as the sparse model up to
``dense_len`` tokens). KV cache: transformers' ``Cache`` objects (``DynamicCache``), so ``generate()`` works.
Works with transformers 4.46+ and 5.x and plain PyTorch operations (CPU or GPU).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_minicpm import MiniCPMConfig

logger = logging.get_logger(__name__)

# transformers 5.x renamed ``past_key_values`` to ``cache`` (generate passes ``cache=``; outputs have a ``cache``
# field); 4.x uses ``past_key_values``. This file takes either and returns the field the installed version has.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _given_cache(past_key_values, kwargs):
    cache = kwargs.pop("cache", None)
    if past_key_values is not None and cache is not None and cache is not past_key_values:
        raise ValueError("pass the KV cache once, as cache or as past_key_values")
    return past_key_values if past_key_values is not None else cache


def _longrope(config):
    """``(ext_factors, magnitude)`` of the config's LongRoPE (``None, 1.0`` without ``rope_scaling``)."""
    rs = getattr(config, "rope_scaling", None)  # transformers 5: an alias of rope_parameters
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if not rs or kind in (None, "default"):
        return None, 1.0
    if kind != "longrope":
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported by this MiniCPM file; use 'longrope'")
    orig = rs.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    if not orig:
        raise ValueError("rope_scaling (longrope) needs original_max_position_embeddings")
    max_pos = config.max_position_embeddings
    ext = rs["long_factor"] if max_pos > orig else rs["short_factor"]
    if len(ext) != config.head_dim // 2:
        raise ValueError(f"rope_scaling factor lists have {len(ext)} entries; head_dim / 2 = {config.head_dim // 2}")
    magnitude = math.sqrt(1.0 + math.log(max_pos / orig) / math.log(orig)) if max_pos > orig else 1.0
    return [float(x) for x in ext], magnitude


class MiniCPMRMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32: ``weight * x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class MiniCPMLongRoPE(nn.Module):
    """cos / sin ``[batch, seq, head_dim]`` (float32) for ``position_ids`` ``[batch, seq]``.

    Computed from the config's numbers in every call (no buffers: nothing to re-initialise after loading)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.base = float(config.rope_theta)
        self.ext, self.magnitude = _longrope(config)

    def forward(self, position_ids):
        dev = position_ids.device
        idx = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=dev).float()
        inv_freq = 1.0 / (self.base ** (idx / self.head_dim))
        t = position_ids.float()[..., None]
        if self.ext is not None:
            t = t * (1.0 / torch.tensor(self.ext, dtype=torch.float32, device=dev))
        emb = t * inv_freq
        emb = torch.cat([emb, emb], dim=-1)
        return emb.cos() * self.magnitude, emb.sin() * self.magnitude


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x, cos, sin):
    """``x`` ``[batch, heads, seq, head_dim]``; ``cos``/``sin`` ``[batch, seq, head_dim]``; float32 math."""
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class MiniCPMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MiniCPMAttention(nn.Module):
    """Dense grouped-query attention with LongRoPE and a KV cache (``Cache.update``)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, past_key_values=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        group = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        probs = scores.softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MiniCPMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniCPMAttention(config, layer_idx)
        self.mlp = MiniCPMMLP(config)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = float(config.scale_depth) / math.sqrt(config.num_hidden_layers)

    def forward(self, h, cos, sin, mask, past_key_values=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, past_key_values) * self.residual_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale


def _attention_mask(attention_mask, batch, seq, past, device):
    """Additive float32 mask ``[batch, 1, seq, past + seq]``: causal, and the 2-D padding mask when given (a 4-D
    mask, which transformers builds for a static cache of fixed length, is used as given)."""
    if attention_mask is not None and attention_mask.dim() == 4:  # built by transformers (static caches): as given
        mask = attention_mask[:, :, -seq:, :]
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(
                ~mask, torch.finfo(torch.float32).min)
        return mask.float()
    total = past + seq
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None].expand(batch, 1, seq, total)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("attention_mask must be [batch, past + seq] (1 = attend, 0 = padding) or the 4-D "
                             "[batch, 1, seq, keys] mask transformers builds")
        allowed = allowed & attention_mask[:, None, None, -total:].bool()
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)


class MiniCPMPreTrainedModel(PreTrainedModel):
    config_class = MiniCPMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MiniCPMDecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, MiniCPMRMSNorm):
            module.weight.data.fill_(1.0)


class MiniCPMModel(MiniCPMPreTrainedModel):
    """The decoder: ``input_ids`` ``[batch, seq]`` -> final-norm hidden states ``[batch, seq, hidden_size]``."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MiniCPMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MiniCPMLongRoPE(config)
        if getattr(config, "sparse_config", None):
            logger.warning("sparse_config (InfLLM v2) is set: this MiniCPM file attends every token (dense); the "
                           "outputs equal the sparse model's up to its dense_len tokens")
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, **kwargs):
        past_key_values = _given_cache(past_key_values, kwargs)
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        h = inputs_embeds * float(self.config.scale_emb)
        batch, seq = h.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=h.device)[None].expand(batch, seq)
        cos, sin = self.rotary_emb(position_ids)
        mask = _attention_mask(attention_mask, batch, seq, past, h.device)
        hidden = []
        for layer in self.layers:
            hidden.append(h)
            h = layer(h, cos, sin, mask, past_key_values)
        h = self.norm(h)
        return BaseModelOutputWithPast(last_hidden_state=h, hidden_states=tuple(hidden + [h]) if output_hidden_states
                                       else None, **{_CACHE_FIELD: past_key_values if use_cache else None})


class MiniCPMForCausalLM(MiniCPMPreTrainedModel, GenerationMixin):
    """:class:`MiniCPMModel` plus the output head: logits ``[batch, seq, vocab_size]`` (float32)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = MiniCPMModel(config)
        # tied: the head reads embed_tokens directly (no second parameter, nothing for loaders to re-tie)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        logits_to_keep = kwargs.pop("num_logits_to_keep", None) or logits_to_keep
        past_key_values = _given_cache(past_key_values, kwargs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=kwargs.pop("output_hidden_states", None))
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        h = h / (self.config.hidden_size / self.config.dim_model_base)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, weight).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})
