"""lm-evaluation-harness backend: run any ``lm_eval`` task against a checkpoint of this project.

The class :class:`MiniCPM4LM` is registered with lm-eval as ``minicpm4-jax`` (alias
``minicpm4_jax``) when this module is imported. lm-eval has no plug-in discovery for models, so
use either the Python API::

    import lm_eval, minicpm4_jax.eval.lm_eval_backend as be
    lm = be.MiniCPM4LM(checkpoint="runs/x")                  # or MiniCPM4LM(model=an_eval_model)
    lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=DIR))

or the launcher, which imports this module and then runs lm-eval's own command line::

    python -m minicpm4_jax.eval.lm_eval_backend run --model minicpm4-jax \\
        --model_args checkpoint=runs/x,attention=sparse --tasks my_task --include_path DIR

Tokenisation follows ``TemplateLM``: the context's trailing whitespace moves to the
continuation, the pair is encoded jointly and split at ``len(encode(context))`` (at the longest
common prefix when the joint encoding merges across the boundary); an empty context is
conditioned on the model's own document prefix (EOS or BOS), which the eval model adds to
every request. Scoring, batching, length truncation and the KV cache live in the eval model
(``minicpm4_jax.eval.model.EvalModel``); this class only adapts requests and results.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Sequence

import numpy as np

from minicpm4_jax.config import ConfigError
from minicpm4_jax.eval.bench.gen import can_cut_prompts, cut_at_stop

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    HAVE_LM_EVAL = True
except ImportError:  # the backend is optional; the scoring helper below is not
    HAVE_LM_EVAL = False
    TemplateLM = object  # type: ignore[assignment,misc]

    def register_model(*_names):  # type: ignore[no-redef]
        return lambda cls: cls


MODEL_NAME = "minicpm4-jax"


def _int_arg(name: str, v, minimum: int | None = None) -> int:
    """``--model_args`` value ``name`` as an int (lm-eval passes ``"abc"`` through as text).

    Raises:
        ConfigError: not an integer (``"3"``, ``3`` and ``3.0`` are), or below ``minimum``.
    """
    bound = "" if minimum is None else f" >= {minimum}"
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={v!r} in --model_args must be an integer{bound}") from None
    if minimum is not None and n < minimum:
        raise ConfigError(f"{name}={v!r} in --model_args must be an integer{bound}")
    return n


def _int_or_none(name: str, v, minimum: int | None = None) -> int | None:
    if v is None or v == "" or str(v).lower() == "none":
        return None
    return _int_arg(name, v, minimum)


def _register(cls):
    # Run as ``python -m``, this file is ``__main__``: the launcher below imports the real module,
    # which registers the class once (lm-eval refuses a second class under the same name).
    if __name__ == "__main__" or not HAVE_LM_EVAL:
        return cls
    return register_model(MODEL_NAME, "minicpm4_jax")(cls)


@_register
class MiniCPM4LM(TemplateLM):
    """lm-eval ``LM`` over this project's eval model (anything with the ``EvalModel`` protocol)."""

    def __init__(self, checkpoint: str | None = None, step=None, attention: str | None = None, batch_size=8,
                 prefill_chunk=512, max_gen_toks=256, seed=0, model=None, max_batch_size=None, device=None,
                 prefix: str = "auto", max_length=None, **unknown) -> None:
        if not HAVE_LM_EVAL:
            raise ImportError("the lm-eval backend needs the lm-eval package (pip install 'lm-eval>=0.4.13,<0.5')")
        if unknown:  # (lm-eval itself adds only batch_size, max_batch_size and device)
            raise ConfigError(f"unknown --model_args {', '.join(sorted(unknown))} for --model {MODEL_NAME}; known: "
                              "checkpoint, step, attention, prefill_chunk, prefix, max_length, max_gen_toks, seed "
                              "(the batch size is lm-eval's --batch_size)")
        super().__init__()
        # every number first, before a checkpoint is read (int('abc') was a traceback)
        max_gen_toks, seed = _int_arg("max_gen_toks", max_gen_toks, 1), _int_arg("seed", seed)
        if model is None:
            if not checkpoint:
                raise ConfigError(f"--model {MODEL_NAME} needs --model_args checkpoint=PATH")
            from minicpm4_jax.eval.model import EvalModel

            bs = (8 if batch_size in (None, "", "auto") or str(batch_size).startswith("auto")
                  else _int_arg("batch_size", batch_size, 1))
            att = None if attention in (None, "", "none", "None") else str(attention)
            step, chunk = _int_or_none("step", step, 0), _int_arg("prefill_chunk", prefill_chunk, 1)
            max_length = _int_or_none("max_length", max_length, 1)
            model = EvalModel.from_checkpoint(checkpoint, step=step, attention=att, batch_size=bs,
                                              prefill_chunk=chunk, prefix=str(prefix),
                                              max_length=max_length, path_option="checkpoint")
        self.model = model
        self._tok = model.tokenizer
        self.max_gen_toks = max_gen_toks
        self.seed = seed

    # --- TemplateLM hooks -----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self._tok.eos_id
        if eos is None:
            raise ValueError("the tokenizer has no end-of-text token")
        return int(eos)

    @property
    def _model_adds_prefix(self) -> bool:
        # EvalModel puts its document-start token (``prefix_ids``, EOS by this project's training
        # convention) before every context; a model without the attribute is taken to do the same.
        return bool(getattr(self.model, "prefix_ids", True))

    @property
    def prefix_token_id(self) -> int:
        ids = getattr(self.model, "prefix_ids", None)
        if ids:
            return int(ids[0])
        bos = getattr(self._tok, "bos_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """TemplateLM's split (trailing context whitespace moves to the continuation; the pair is
        encoded jointly and cut at ``len(encode(context))``), except that when the joint encoding
        merges tokens across the boundary the cut is the longest common prefix, so both parts come
        from the joint tokenisation and no continuation text is scored as context (as
        ``EvalModel.encode_pair`` does)."""
        from minicpm4_jax.eval.model import joint_encode_pair

        return joint_encode_pair(self.tok_encode, context, continuation)

    @property
    def max_length(self) -> int:
        return int(self.model.max_length)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.model, "name", MODEL_NAME))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self._tok.encode(string))

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self._tok.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = []
        for (context, _continuation), ctx, cont in requests:
            ctx = list(ctx)
            if context == "" and ctx == [self.prefix_token_id] and self._model_adds_prefix:
                ctx = []  # the eval model prepends its document prefix to every request itself
            pairs.append((ctx, list(cont)))
        res = self.model.loglikelihood_tokens(pairs)
        if len(res) != len(pairs):
            raise RuntimeError(f"eval model returned {len(res)} results for {len(pairs)} requests")
        out = [(float(lp), bool(g)) for lp, g in res]
        for (req_str, _, _), ans in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req_str, ans)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        res = [float(x) for x in self.model.loglikelihood_rolling(texts)]
        for req, r in zip(requests, res):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), r)
        return res

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of ``(context, gen_kwargs)`` requests, cut at the first ``until`` string (and EOS).

        The sampling settings are those lm-eval's Hugging Face backend (0.4.13: ``normalize_gen_kwargs``,
        ``HFLM._model_generate``) hands to transformers' ``generate`` for the same ``gen_kwargs``: ``do_sample``
        absent samples when ``temperature`` > 0 and is greedy otherwise; ``do_sample: false`` is greedy whatever
        the temperature; ``do_sample: true`` without a ``temperature`` > 0 is a :class:`ConfigError` (transformers
        raises ``temperature (=0.0) has to be a strictly positive float``). When sampling, an absent ``top_k`` /
        ``top_p`` takes ``GenerationConfig``'s default (50 / 1.0): this project's checkpoints carry no generation
        config (an export's ``generation_config.json`` names only the special-token ids), so those are what
        transformers uses on an exported model; ``None`` or 0 means no cut (as in transformers). An imported
        official checkpoint's own ``generation_config.json`` (``top_p: 0.8``) is not kept: give ``top_p`` in the
        task to match transformers on the original folder. ``top_p`` outside (0, 1] or a negative ``top_k``:
        :class:`ConfigError` before any generation. ``max_gen_toks`` (or lm-eval's aliases ``max_new_tokens``,
        ``max_tokens``, ``max_completion_tokens``, in that priority) defaults to the backend's. A context longer
        than ``max_length - max_gen_toks`` keeps its last tokens (a warning on stderr says how many were cut).
        """
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        settings: dict[str, dict] = {}
        for i, req in enumerate(requests):
            ctx, kw = req.args[0], dict(req.args[1] or {})
            until = kw.get("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            max_toks = _max_gen_toks(kw, self.max_gen_toks)
            temp = _sampling_temperature(kw)
            s = {"until": until, "max_new_tokens": max_toks, "temperature": temp}
            if temp > 0:  # a sampling task's nucleus / top-k settings (were dropped: plain temperature sampling)
                s.update(_sampling_cuts(kw))
            key = json.dumps(s, sort_keys=True)
            settings[key] = s
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            s = settings[key]
            # a context longer than max_length - max_gen_toks keeps its last tokens, as lm-eval's HF backend does
            prompts = [requests[i].args[0] for i in idx]
            kw = dict(max_new_tokens=s["max_new_tokens"], stop=s["until"], temperature=s["temperature"],
                      seed=self.seed, **{k: s[k] for k in ("top_p", "top_k") if k in s})
            if can_cut_prompts(self.model):
                texts, cuts = self.model.generate(prompts, truncate=True, return_cuts=True, **kw)
            else:
                texts, cuts = self.model.generate(prompts, **kw), [0]
            n_cut = sum(1 for c in cuts if c)
            if n_cut:
                print(f"minicpm4-jax: warning: generate_until cut {n_cut} of {len(idx)} contexts from the left to "
                      f"max_length={self.model.max_length} - max_gen_toks={s['max_new_tokens']} tokens (up to "
                      f"{max(cuts)} tokens each)", file=sys.stderr)
            if len(texts) != len(idx):
                raise RuntimeError(f"eval model returned {len(texts)} generations for {len(idx)} prompts")
            for i, t in zip(idx, texts):
                t = cut_at_stop(t, s["until"])
                out[i] = t
                self.cache_hook.add_partial("generate_until", requests[i].args, t)
        return [o if o is not None else "" for o in out]


# lm-eval's names for the number of new tokens, by priority (0.4.13 ``normalize_gen_kwargs``: HF, vLLM, OpenAI)
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def _max_gen_toks(gen_kwargs: dict, default: int) -> int:
    """The number of new tokens a request's ``gen_kwargs`` asks for: the first of :data:`MAX_TOKEN_KEYS` that is set
    (not ``None``), as lm-eval's Hugging Face backend reads it, else ``default`` (the backend's ``max_gen_toks``).

    Raises:
        ConfigError: a value that is not a whole number >= 1.
    """
    for key in MAX_TOKEN_KEYS:
        value = gen_kwargs.get(key)
        if value is None:
            continue
        try:
            n = None if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            n = None
        if n is None or not n.is_integer() or n < 1:
            raise ConfigError(f"generate_until gen_kwargs: {key}={value!r} is not a whole number >= 1; fix the "
                              "task's generation_kwargs")
        return int(n)
    return int(default)


# transformers' GenerationConfig default top_k, used when a sampling request gives none (see generate_until)
HF_DEFAULT_TOP_K = 50


def _sampling_temperature(gen_kwargs: dict) -> float:
    """The temperature a request's ``gen_kwargs`` samples at, 0.0 for greedy, as lm-eval's Hugging Face backend
    decides (``do_sample`` absent: sample iff ``temperature`` > 0; ``false``: greedy).

    Raises:
        ConfigError: ``do_sample: true`` without a ``temperature`` > 0 (transformers' ``generate`` refuses it).
    """
    try:
        temp = float(gen_kwargs.get("temperature") or 0.0)
    except (TypeError, ValueError):
        raise ConfigError(f"generate_until gen_kwargs: temperature={gen_kwargs.get('temperature')!r} is not a "
                          "number; fix the task's generation_kwargs") from None
    do_sample = gen_kwargs.get("do_sample")
    if do_sample is None:
        do_sample = temp > 0
    if not do_sample:
        return 0.0
    if not temp > 0:
        raise ConfigError(f"generate_until gen_kwargs: do_sample: true needs a temperature > 0, got "
                          f"{gen_kwargs.get('temperature', 'none')} (lm-eval's Hugging Face backend fails there too); "
                          "set the task's temperature, or do_sample: false for greedy decoding")
    return temp


def _sampling_cuts(gen_kwargs: dict) -> dict:
    """``{"top_p": p, "top_k": k}`` of a sampling request's ``gen_kwargs``, each left out when no cut (``top_p`` 1 or
    ``None``, ``top_k`` 0 or ``None``); an absent ``top_k`` is transformers' default, :data:`HF_DEFAULT_TOP_K`.

    Raises:
        ConfigError: a value :class:`~minicpm4_jax.infer.sampling.SamplingParams` refuses (e.g. ``top_p`` 0, which
            Hugging Face reads as "the top token only" and vLLM refuses), before any request is generated.
    """
    from minicpm4_jax.infer.sampling import SamplingParams

    top_p, top_k = gen_kwargs.get("top_p"), gen_kwargs.get("top_k")
    try:
        p = 1.0 if top_p is None else float(top_p)
        if "top_k" not in gen_kwargs:
            top_k = HF_DEFAULT_TOP_K
        k = 0 if top_k is None else int(top_k) if isinstance(top_k, float) and top_k.is_integer() else top_k
        SamplingParams(1.0, k, p).validate()
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"generate_until gen_kwargs: {e}; fix the task's generation_kwargs, or set do_sample: "
                          "false") from None
    return {**({"top_p": p} if p != 1.0 else {}), **({"top_k": int(k)} if k else {})}


def score_tokens_with_logits(logits_fn: Callable[[list[int]], np.ndarray],
                             requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, max_length: int,
                             prefix: Sequence[int] = ()) -> list[tuple[float, bool]]:
    """Reference continuation scoring (field fault B19), one sequence at a time.

    ``whole = prefix + context + continuation``, left-truncated to ``max_length + 1`` tokens;
    the model input is ``whole[:-1]`` and the last ``len(continuation)`` rows of its logits
    (``logits_fn(input) -> [len(input), vocab]``) predict the continuation tokens. Returns the
    summed log-probability and whether every continuation token is the argmax.
    """
    out = []
    for ctx, cont in requests:
        cont = list(cont)
        if not cont:
            out.append((0.0, True))
            continue
        whole = list(prefix) + list(ctx) + cont
        if len(cont) > max_length:
            raise ValueError(f"continuation of {len(cont)} tokens does not fit max_length {max_length}")
        whole = whole[-(max_length + 1):]
        inp = whole[:-1]
        logits = np.asarray(logits_fn(inp), dtype=np.float64)
        if logits.shape[0] != len(inp):
            raise ValueError(f"logits_fn returned {logits.shape[0]} rows for {len(inp)} input tokens")
        rows = logits[len(inp) - len(cont):]
        m = rows.max(axis=-1, keepdims=True)
        logp = rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))
        tgt = np.asarray(cont)
        lp = float(logp[np.arange(len(cont)), tgt].sum())
        greedy = bool((rows.argmax(axis=-1) == tgt).all())
        out.append((lp, greedy))
    return out


def _check_cli_args(args: Sequence[str]) -> None:
    """Refuse, in one line, lm-eval arguments that would end in a traceback or a meaningless table.

    The arguments are parsed by lm-eval's own parser (its abbreviations, JSON ``--model_args``), then checked.

    Raises:
        ConfigError: ``--apply_chat_template`` / ``--fewshot_as_multiturn`` (this backend has no chat template),
            ``batch_size``/``max_batch_size``/``device`` inside ``--model_args`` (lm-eval passes its own
            ``--batch_size``... to the model as well: "got multiple values for keyword argument"), a ``--limit``
            that is not a finite number > 0, a ``--num_fewshot`` that is not an integer >= 0.
    """
    import math

    from lm_eval._cli import HarnessCLI

    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        ns = HarnessCLI().parse_args()
    finally:
        sys.argv = saved
    model_args = getattr(ns, "model_args", None) or {}
    if isinstance(model_args, str):
        model_args = {kv.split("=", 1)[0].strip(): None for kv in model_args.split(",") if "=" in kv}
    dup = sorted(set(model_args) & {"batch_size", "max_batch_size", "device"})
    if dup:
        raise ConfigError(f"{dup[0]} in --model_args: lm-eval passes its own --{dup[0]} to the model too; give it as "
                          f"--{dup[0]} VALUE instead")
    chat = [f"--{a}" for a in ("apply_chat_template", "fewshot_as_multiturn") if getattr(ns, a, None)]
    if chat:  # (was lm-eval's NotImplementedError traceback after the model had loaded)
        raise ConfigError(f"{chat[0]}: {MODEL_NAME} has no chat template (every prompt is plain text, as runs trained "
                          "here see them); drop it, or for an imported chat model write its chat format into the task's "
                          "prompts")
    limit, shots = getattr(ns, "limit", None), getattr(ns, "num_fewshot", None)
    if limit is not None and not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
        raise ConfigError(f"--limit {limit}: give a number > 0 (documents per task, or a fraction below 1)")
    if shots is not None and not (isinstance(shots, (int, float)) and math.isfinite(shots) and shots >= 0
                                  and float(shots).is_integer()):
        raise ConfigError(f"--num_fewshot {shots}: give an integer >= 0")


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line with ``minicpm4-jax`` registered (this module is imported); the persistent
    compilation cache is on as for ``minicpm4`` (:mod:`minicpm4_jax.compilation_cache`)."""
    if not HAVE_LM_EVAL:
        print("error: the lm-eval backend needs the lm-eval package (pip install 'lm-eval>=0.4.13,<0.5')",
              file=sys.stderr)
        raise SystemExit(2)
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["lm-eval", *args]
    try:
        _check_cli_args(args)
        from minicpm4_jax.compilation_cache import configure_compilation_cache

        configure_compilation_cache()  # as the `minicpm4` command: a re-run loads the compiled programs
        from minicpm4_jax.ops import native

        native.check_settings()
        cli_evaluate()
    except ConfigError as e:  # this backend's own input errors (model_args, checkpoint): one line, status 2
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as e:
        if "Sample larger than population" not in str(e):
            raise
        print("error: --num_fewshot asks for more examples than a task's few-shot split holds "
              f"({' '.join(str(e).split())}); lower --num_fewshot", file=sys.stderr)
        raise SystemExit(2) from None
    except FileNotFoundError as e:  # e.g. datasets' "Unable to find '<data file>'" for a task YAML's data_files
        print(f"error: {' '.join(str(e).split())}; fix the path (dataset_kwargs.data_files of a task YAML: relative "
              "paths start from the folder lm-eval runs in)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    from minicpm4_jax.eval.lm_eval_backend import main as _main

    _main()
