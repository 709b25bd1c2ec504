"""Decode speed of the KV-cache engine at long contexts: dense against InfLLM v2 sparse (issue 9).

One model (default: the ``cpu_tiny`` architecture, random weights, max positions raised to fit the longest
context), batch 1 (``--batch``), fp32, CPU. For each context length ``N`` the cache is filled
**synthetically** with random post-RoPE keys and values (and the compressed keys computed from them with
:func:`~minicpm4_jax.infllm.compress.compress_keys`, exactly what prefill would store), because a real
prefill of 32K tokens costs minutes and does not change what a decode step does: every step still runs the
whole model on the new token, writes it into the cache, and attends the cache (dense: all ``N`` keys;
sparse: stage 1 over the compressed keys, then only the selected blocks). Both variants run the same
jitted decode step of :class:`~minicpm4_jax.infer.engine.InferenceEngine` with greedy sampling.

Sparse settings: the model's ``sparse_config`` or the MiniCPM4.1 defaults (gen-2, block 64, kernel 32/16,
topk 64 + window 2048 = 96 blocks = 6144 keys, dense_len 8192): below 8192 the sparse model decodes densely
by design, and at 4K the 96 blocks cover the whole context anyway.

Timing: after one compile-and-warm-up step per variant, ``--rounds`` rounds alternate dense and sparse,
each running ``--warmup`` untimed steps (speculative variants: ``max(1, warmup // (num_draft + 1))`` untimed
rounds) and then timing ``--steps`` consecutive decode steps; the median per-step time is reported. The
untimed steps refill the CPU caches with the variant's own cache blocks after the other variants ran: a
decode loop never has another model's 200 MB cache run between its steps. Timed one by one on the 2-core
CPU at 32K, sparse steps right after 36 dense steps took 6.9, 6.1, 5.6, ... ms and settled at ~4.5 ms after
8-16 steps, dense steps were steady from the first (``docs/benchmarks.md``); ``--warmup 0`` measures the
cold rounds too. The bound is the
ratio of KV-cache values read per step per KV head: dense ``2 N`` (K and V) against sparse
``2 * min(K * block, N) + Nc1 + Nc2`` (selected K and V plus the fine and coarse compressed keys stage 1
reads). The rest of the step (projections, MLP, head) is the same for both and lowers the real ratio: the
"+weights" bound adds the weights a step reads (every parameter but the MTP head's, once per step) to both
sides, the ratio of all bytes a memory-bound step moves.

Speculative decoding (``--checkpoint RUN`` of a model trained with its MTP head, e.g. ``make train``):

* **at the trained length** (the question a draft trained on short windows can answer): held-out
  documents of the run's own validation split, a ``--prompt-len`` prompt and ``--gen-len`` greedy tokens
  (together the training ``seq_len``), decoded plain, speculative and speculative + FR-Spec with the real
  engine (``generate``); reports decode tokens/s and the measured acceptance length (tokens per verify).
* **at 4K/16K/32K** (synthetic caches as above, the draft layer's cache too): tokens/s of speculative rounds
  of the sparse model with the trained weights. The acceptance there is measured too, but on random caches
  it says nothing about real long inputs (the draft never saw one).

Run::

    .venv/bin/python scripts/bench_decode.py                               # 4K, 16K, 32K, random weights
    .venv/bin/python scripts/bench_decode.py --checkpoint runs/cpu_tiny --fr-spec-vocab 2048   # + speculative
    .venv/bin/python scripts/bench_decode.py --lengths 4096 8192 --steps 16 --rounds 3 --json out.json
    .venv/bin/python scripts/bench_decode.py --lengths 32768 --batch 4   # 4 sequences per step
    .venv/bin/python scripts/bench_decode.py --generate-loop --batch 4 --rounds 7   # generate(): pipelined loop

With ``--batch B`` every step decodes B sequences of the same length (tok/s counts all of them): the weights are
read once per step for all B, so the "+weights" bound moves towards the KV-only one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range
from minicpm4_jax.config import load_config
from minicpm4_jax.infer.cache import KVCache, cache_capacity, init_cache
from minicpm4_jax.infer.engine import InferenceEngine, decode_mode, with_attention
from minicpm4_jax.infer.sampling import SamplingParams
from minicpm4_jax.infllm.compress import coarse_geometry, compress_keys, num_kernels
from minicpm4_jax.infllm.select import select_params
from minicpm4_jax.nn.model import MiniCPM4


def synthetic_cache(cfg, n: int, capacity: int, seed: int, batch: int = 1) -> KVCache:
    """A cache of ``batch`` sequences holding ``n`` tokens each of random keys/values (and their compressed keys
    for InfLLM v2)."""
    cache = init_cache(cfg, batch, capacity)
    key = jax.random.key(seed)
    layers = []
    for lc in cache.layers:
        key, k1, k2 = jax.random.split(key, 3)
        shape = lc.k.shape
        valid = (jnp.arange(capacity) < n)[None, None, :, None]
        k = jnp.where(valid, jax.random.normal(k1, shape, lc.k.dtype), 0)
        v = jnp.where(valid, jax.random.normal(k2, shape, lc.v.dtype), 0)
        new = dataclasses.replace(lc, k=k, v=v)
        if lc.ck1 is not None:
            sc = cfg.sparse_config
            kk = k.transpose(0, 2, 1, 3)[:, :n]
            c1 = compress_keys(kk, sc.kernel_size, sc.kernel_stride)
            new.ck1 = lc.ck1.at[:, :c1.shape[1]].set(c1)
            if lc.ck2 is not None:
                c2 = compress_keys(kk, *coarse_geometry(sc.kernel_size, sc.kernel_stride))
                new.ck2 = lc.ck2.at[:, :c2.shape[1]].set(c2)
        layers.append(new)
    return KVCache(layers=tuple(layers), lengths=jnp.full((batch,), n, jnp.int32))


def bound(cfg, n: int, weight_bytes: float = 0) -> float:
    """Bytes read per decode step, dense / sparse (module docstring): the KV values of every layer and KV head
    (float32), plus ``weight_bytes`` per sequence (the weights a step reads, the same for both, divided by the
    batch; 0 = the KV-only bound)."""
    sc = cfg.sparse_config
    p = select_params(sc)
    if 0 < sc.dense_len and n < sc.dense_len:
        return 1.0
    sparse = 2 * min(p.topk_cfg * sc.block_size, n) + num_kernels(n, sc.kernel_size, sc.kernel_stride)
    if sc.variant == "gen2":
        sparse += num_kernels(n, *coarse_geometry(sc.kernel_size, sc.kernel_stride))
    per_value = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.resolved_head_dim * 4
    return (2 * n * per_value + weight_bytes) / (sparse * per_value + weight_bytes)


def step_weight_bytes(model) -> int:
    """Bytes of the weights one plain decode step reads: every parameter but the MTP draft head's."""
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return sum(x.nbytes for path, x in leaves if "mtp" not in jax.tree_util.keystr(path))


class Runner:
    """One engine, one cache of ``batch`` sequences, a decode step that can be timed repeatedly (the cache keeps
    growing)."""

    def __init__(self, model, n: int, capacity: int, seed: int, batch: int = 1):
        self.engine = InferenceEngine(model)
        # the engine's static per-step dispatch; the runs below never cross dense_len
        self.step_fn = self.engine.decode_fn(SamplingParams(), mode=decode_mode(model.cfg, [n + 1] * batch))
        self.cache = synthetic_cache(model.cfg, n, capacity, seed, batch)
        self.tok = jnp.zeros((batch,), jnp.int32)
        self.active = jnp.ones((batch,), bool)
        self.seeds = jnp.zeros((batch,), jnp.uint32)
        self.i = 0
        self.fracs: list[float] = []

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` consecutive decode steps."""
        t0 = time.perf_counter()
        for _ in range(steps):
            # the step as a numpy scalar, as the engine passes it (a jnp scalar dispatches a program of its own)
            self.cache, self.tok, frac, _ = self.step_fn(self.engine.weights, self.cache, self.tok, self.active,
                                                         self.seeds, np.int32(self.i))
            self.i += 1
        self.tok.block_until_ready()
        self.fracs.append(float(np.mean(frac)))
        return (time.perf_counter() - t0) / steps


class SpecRunner:
    """Speculative rounds on a synthetic cache (target and draft), timed like :class:`Runner`."""

    def __init__(self, model, n: int, capacity: int, seed: int, num_draft: int, fr_ids=None):
        from minicpm4_jax.infer.spec import SpecState, SpeculativeDecoder

        self.engine = InferenceEngine(model)
        self.dec = SpeculativeDecoder(self.engine, model.mtp, num_draft=num_draft, fr_spec_ids=fr_ids)
        cfg = model.cfg
        draft_cfg = dataclasses.replace(cfg, num_hidden_layers=1, attention="dense", sparse_config=None)
        dcache = synthetic_cache(draft_cfg, n - 1, capacity, seed + 7).layers[0]
        h = jax.random.normal(jax.random.key(seed + 3), (1, cfg.hidden_size), jnp.float32)
        self.state = SpecState(cache=synthetic_cache(cfg, n, capacity, seed), dcache=dcache, lengths=[n],
                               h_last=h, tok=jnp.zeros((1,), jnp.int32))
        self.seeds = jnp.zeros((1,), jnp.uint32)
        self.i = 0
        self.produced = 0
        self.rounds = 0

    def run(self, rounds: int) -> tuple[float, int]:
        """(seconds, tokens produced) over ``rounds`` rounds, pipelined as ``generate`` runs them: round ``i + 1``
        is dispatched (its lengths from round ``i`` on the device) before round ``i``'s result is read."""
        from minicpm4_jax.infer.spec import SpecState

        st, dec = self.state, self.dec
        carry, lengths, n = (st.cache, st.dcache, st.h_last, st.tok), np.asarray(st.lengths, np.int32), st.lengths[0]
        t0 = time.perf_counter()
        made, pending = 0, None
        for j in range(rounds + 1):
            launched = None
            if j < rounds:
                self.i += 1
                mode = dec._mode([n], 0 if pending is None else dec.k + 1)
                carry, lengths, packed = dec._launch(*carry, lengths, [True], self.seeds, self.i, SamplingParams(),
                                                     None, mode)
                launched = packed
            if pending is not None:
                a = dec._unpack(np.asarray(pending))[0][0]
                made += a + 1
                n += a + 1
            pending = launched
        self.state = SpecState(cache=carry[0], dcache=carry[1], lengths=[n], h_last=carry[2], tok=carry[3])
        self.produced += made
        self.rounds += rounds
        return time.perf_counter() - t0, made


def trained_length_spec(run: str, k: int, fr_vocab: int | None, prompt_len: int, gen_len: int, n_docs: int,
                        passes: int = 2) -> dict:
    """Plain vs speculative (+ FR-Spec) greedy decoding of held-out text at the length the model trained on."""
    from minicpm4_jax.infer.spec import (SpeculativeDecoder, load_frequency_ranking, run_ranking_file,
                                         text_acceptance)
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference
    from minicpm4_jax.train.data import prepare_data

    from minicpm4_jax.config import ConfigError

    tcfg, model = load_params_for_inference(find_checkpoint_dir(run))
    if not model.cfg.mtp:
        raise ConfigError(f"{run} was trained without its MTP draft head (model.mtp=false): the trained-length "
                          "measurement compares speculative decoding with it; give a run trained with model.mtp=true")
    data = prepare_data(tcfg.data, log=lambda m: None)
    val = np.asarray(data.val_tokens)
    eos = data.tokenizer.eos_id
    starts = [0] + [int(i) + 1 for i in np.flatnonzero(val == eos)]
    # each document's first prompt_len + gen_len held-out tokens: the prompt, then the text it continues
    texts = np.asarray([val[s_:s_ + prompt_len + gen_len] for s_ in starts
                        if s_ + prompt_len + gen_len <= len(val) and eos not in val[s_:s_ + prompt_len]][:n_docs])
    if not len(texts):
        raise ConfigError(f"no held-out document of {run} has --prompt-len {prompt_len} + --gen-len {gen_len} tokens "
                          f"(the run trained on {tcfg.data.seq_len}-token windows): give shorter lengths")
    prompts = [t[:prompt_len].tolist() for t in texts]
    eng = InferenceEngine(model)
    variants = {"plain": None, f"spec k={k}": SpeculativeDecoder(eng, model.mtp, num_draft=k)}
    ids = None
    if fr_vocab:
        ids = load_frequency_ranking(run_ranking_file(run, fr_vocab), model.cfg.vocab_size)[:fr_vocab]
        variants[f"spec k={k} + FR-Spec {fr_vocab}"] = SpeculativeDecoder(eng, model.mtp, num_draft=k,
                                                                         fr_spec_ids=ids)
    # the last variant again with every round read before the next is dispatched (the loop before pipelining)
    last = list(variants)[-1]
    variants[f"{last}, rounds read one by one"] = SpeculativeDecoder(InferenceEngine(model, pipelined=False),
                                                                     model.mtp, num_draft=k, fr_spec_ids=ids)
    # the draft on the held-out text itself (teacher-forced, every start position; text_acceptance): what the
    # acceptance would be without the model's own generation (its repetition loops) in the way
    text_acc = {f"spec k={k}": text_acceptance(model, texts, k)}
    if fr_vocab:
        text_acc[f"spec k={k} + FR-Spec {fr_vocab}"] = text_acceptance(model, texts, k, ids)
    gens = {name: (eng.generate if dec is None else dec.generate) for name, dec in variants.items()}
    for gen in gens.values():
        gen([prompts[0]], gen_len)  # compile + warm-up
    # variants interleaved document by document, `passes` times, so drift of the machine hits all alike
    secs, toks = dict.fromkeys(gens, 0.0), dict.fromkeys(gens, 0)
    acc, tokens = {n: [] for n in gens}, {n: [] for n in gens}
    for i in range(passes):
        for p in prompts:
            for name, gen in gens.items():
                o = gen([p], gen_len)
                secs[name] += o.decode_seconds
                toks[name] += o.new_tokens - 1  # the first token comes from prefill
                # (tokens per verify, verifies that kept tokens): decode_steps also counts a pipelined loop's
                # discarded last round
                acc[name].append((o.acceptance_length, (o.new_tokens - 1) / o.acceptance_length))
                if i == 0:
                    tokens[name].append(o.tokens[0])
    def pooled(a):  # tokens per verify over all rounds of all documents (what the speed sees)
        return float(sum(x * n for x, n in a) / sum(n for _, n in a))

    # acceptance: pooled over all rounds; acceptance_doc_mean: the mean of the documents' own acceptance lengths
    # (weighs a document that needed few rounds as much as one that needed many: larger than the pooled one)
    out = {name: dict(tok_s=toks[name] / secs[name],
                      acceptance=1.0 if variants[name] is None else pooled(acc[name]),
                      acceptance_doc_mean=1.0 if variants[name] is None else float(np.mean([x for x, _ in acc[name]])),
                      text_acceptance=text_acc.get(name.split(",")[0], {}).get("acceptance", 1.0),
                      text_rate=text_acc.get(name.split(",")[0], {}).get("rate"),
                      identical=tokens[name] == tokens["plain"]) for name in gens}
    return dict(prompts=len(prompts), prompt_len=prompt_len, gen_len=gen_len, passes=passes, results=out)


def generate_loop(cfg, batches: list[int], prompt_len: int, gen_len: int, rounds: int) -> None:
    """``generate()`` decode tokens/s with the pipelined loop against the sequential one, alternated ``rounds`` times.

    Sampled (temperature 1, seeds fixed: both loops must give identical tokens, checked), without and with a stop
    string that never matches (``detokenize`` = the ids joined as text, a stand-in for a tokenizer's decode: the
    host's stop check runs after every token).
    """
    model = MiniCPM4(dataclasses.replace(cfg, dtype="float32"), rngs=nnx.Rngs(0))
    engines = {"sequential": InferenceEngine(model, pipelined=False), "pipelined": InferenceEngine(model)}
    print(f"# generate(): prompt {prompt_len} + {gen_len} new tokens, temperature 1, {rounds} alternated rounds, "
          f"median decode tok/s (all sequences); jax {jax.__version__}, {jax.devices()[0].platform}")
    print(f"{'batch':>5} {'stop check':>10} {'sequential':>11} {'pipelined':>10} {'ratio':>6}")
    for b in batches:
        rng = np.random.default_rng(b)
        prompts = [[int(x) for x in rng.integers(3, cfg.vocab_size, prompt_len)] for _ in range(b)]
        for stop in (False, True):
            kw = dict(sampling=SamplingParams(temperature=1.0), seeds=1)
            if stop:
                kw.update(stop_strings=["never"], detokenize=lambda ids: " ".join(map(str, ids)))
            for e in engines.values():
                e.generate(prompts, 16, **kw)  # compile + warm-up
            rates: dict[str, list[float]] = {k: [] for k in engines}
            tokens = {}
            for _ in range(rounds):
                for k, e in engines.items():
                    out = e.generate(prompts, gen_len, **kw)
                    rates[k].append(out.decode_tokens_per_second)
                    tokens[k] = out.tokens
            if tokens["sequential"] != tokens["pipelined"]:
                raise SystemExit("the pipelined loop's tokens differ from the sequential loop's")
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"{b:>5} {'yes' if stop else 'no':>10} {med['sequential']:>11.1f} {med['pipelined']:>10.1f} "
                  f"{med['pipelined'] / med['sequential']:>5.2f}x", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--config", default="cpu_tiny", help="preset or YAML whose model architecture is used")
    ap.add_argument("--lengths", type=int_range(1), nargs="*", default=[4096, 16384, 32768],
                    help="context lengths (none: with --checkpoint, only the trained-length measurement)")
    ap.add_argument("--steps", type=int_range(1), default=32, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int_range(1), default=5, help="timed rounds per variant (alternating)")
    ap.add_argument("--warmup", type=int_range(0), default=16,
                    help="untimed decode steps per round before the timed ones (module docstring; default 16)")
    ap.add_argument("--batch", type=int_range(1), default=1,
                    help="sequences decoded together in the dense/sparse rows (tok/s counts all of them); the "
                         "speculative columns are measured at batch 1 only and left out for B > 1; the trained-length "
                         "part always runs at batch 1")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--checkpoint", default=None,
                    help="a run trained with its MTP head: its weights, and the speculative measurements")
    ap.add_argument("--num-draft", type=int_range(1), default=3,
                    help="tokens drafted per speculative round (default 3)")
    ap.add_argument("--fr-spec-vocab", type=int_range(1), default=None,
                    help="also FR-Spec with <checkpoint>/fr_spec/freq_N.txt or .pt (scripts/build_fr_spec.py)")
    ap.add_argument("--prompt-len", type=int_range(1), default=128, help="trained-length prompts: prompt tokens")
    ap.add_argument("--gen-len", type=int_range(1), default=128, help="trained-length prompts: generated tokens")
    ap.add_argument("--docs", type=int_range(1), default=32, help="trained-length prompts: held-out documents")
    ap.add_argument("--passes", type=int_range(1), default=2,
                    help="trained-length prompts: passes over the documents (variants interleaved per document)")
    ap.add_argument("--generate-loop", action="store_true",
                    help="instead: the engine's generate() at --prompt-len + --gen-len, pipelined decode loop against "
                         "reading every step's tokens before the next (random --config weights, batch 1 and --batch)")
    args = ap.parse_args(argv)
    if not args.lengths and not args.checkpoint and not args.generate_loop:
        ap.error("--lengths without any length measures nothing; give context lengths, or --checkpoint RUN for the "
                 "trained-length measurement alone")
    if args.fr_spec_vocab and not args.checkpoint:
        ap.error(f"--fr-spec-vocab {args.fr_spec_vocab} restricts a trained draft head: give --checkpoint RUN (a run "
                 "trained with its MTP head and its FR-Spec ranking), or drop --fr-spec-vocab")
    if args.generate_loop:
        generate_loop(load_config(args.config).model, sorted({1, args.batch}), args.prompt_len, args.gen_len,
                      args.rounds)
        return 0

    spec_rows = None
    if args.checkpoint:
        from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

        res = trained_length_spec(args.checkpoint, args.num_draft, args.fr_spec_vocab, args.prompt_len,
                                  args.gen_len, args.docs, args.passes)
        print(f"# trained length: {res['prompts']} held-out prompts of {res['prompt_len']} tokens + "
              f"{res['gen_len']} greedy tokens, batch 1, {res['passes']} passes, variants interleaved")
        base_tps = res["results"]["plain"]["tok_s"]
        for name, r in res["results"].items():
            print(f"{name:>28}: {r['tok_s']:7.1f} tok/s  {r['tok_s'] / base_tps:5.2f}x  acceptance "
                  + (f"{r['acceptance']:.2f} (mean over documents {r['acceptance_doc_mean']:.2f}; on the held-out "
                     f"text {r['text_acceptance']:.2f})" if name != "plain" else "-") +
                  f"  identical to plain: {r['identical']}", flush=True)
        spec_rows = res
        tcfg, trained = load_params_for_inference(find_checkpoint_dir(args.checkpoint))
        base = trained.cfg
    else:
        base = load_config(args.config).model
    if not args.lengths:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(config=args.checkpoint or args.config, trained_length=spec_rows), f, indent=1,
                          default=str)
        return 0
    longest = max(args.lengths) + (args.rounds + 1) * (args.steps + args.warmup) * (args.num_draft + 1) + 1
    cfg = dataclasses.replace(base, max_position_embeddings=max(base.max_position_embeddings, longest),
                              attention="dense", dtype="float32")
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    if args.checkpoint:  # the trained weights under the longer position limit
        model = nnx.merge(nnx.graphdef(model), nnx.state(trained))
    dense_model = model
    sparse_model = with_attention(model, "infllmv2")  # the preset's sparse_config, else the MiniCPM4.1 defaults
    print(f"# model {args.checkpoint or args.config}: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, head_dim {cfg.resolved_head_dim}; sparse "
          f"{sparse_model.cfg.sparse_config}", flush=True)
    print(f"# jax {jax.__version__}, {jax.devices()[0].platform}, {jax.device_count()} device(s); batch "
          f"{args.batch}, fp32, {args.rounds} rounds x {args.steps} steps after {args.warmup} untimed", flush=True)
    rows = []
    spec = args.checkpoint is not None and cfg.mtp and args.batch == 1
    if args.checkpoint is not None and cfg.mtp and args.batch > 1:
        print(f"# --batch {args.batch}: the long-context speculative columns are left out (measured at batch 1 only)",
              flush=True)
    fr_ids = None
    if spec and args.fr_spec_vocab:
        from minicpm4_jax.infer.spec import load_frequency_ranking, run_ranking_file

        fr_ids = load_frequency_ranking(run_ranking_file(args.checkpoint, args.fr_spec_vocab),
                                        cfg.vocab_size)[:args.fr_spec_vocab]
    head = (f"{'context':>8} {'dense tok/s':>12} {'sparse tok/s':>13} {'ratio':>6} {'bound':>6} {'+weights':>8} "
            f"{'attended':>9}")
    if spec:
        head += f" {'+spec tok/s':>12} {'x sparse':>8} {'acc':>5}"
        if fr_ids is not None:
            head += f" {'+FR tok/s':>10} {'x sparse':>8} {'acc':>5}"
    print(head)
    for n in args.lengths:
        cap = cache_capacity(cfg, n + (args.rounds + 1) * (args.steps + args.warmup) * (args.num_draft + 1) + 1)
        runners = {"dense": Runner(dense_model, n, cap, 1, args.batch),
                   "sparse": Runner(sparse_model, n, cap, 1, args.batch)}
        if spec:
            runners["spec"] = SpecRunner(sparse_model, n, cap, 1, args.num_draft)
            if fr_ids is not None:
                runners["fr"] = SpecRunner(sparse_model, n, cap, 1, args.num_draft, fr_ids)
        for r in runners.values():
            # compile + warm-up; a speculative runner's second round is the pipelined launch (its lengths from the
            # device), a program of its own: one round left it to compile inside the first timed round (helper 75)
            r.run(2 if isinstance(r, SpecRunner) else 1)
        times = {k: [] for k in runners}
        for _ in range(args.rounds):
            for k, r in runners.items():
                if isinstance(r, SpecRunner):
                    r.run(max(1, args.warmup // (args.num_draft + 1)))  # untimed
                    secs, made = r.run(args.steps)
                    times[k].append(secs / made)  # seconds per generated token
                else:
                    if args.warmup:
                        r.run(args.warmup)  # untimed
                    times[k].append(r.run(args.steps))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["dense"] / med["sparse"]
        b = bound(sparse_model.cfg, n)
        bw = bound(sparse_model.cfg, n, step_weight_bytes(sparse_model) / args.batch)
        frac = statistics.mean(runners["sparse"].fracs[1:])
        tps = {k: args.batch / med[k] for k in ("dense", "sparse")}  # tokens of all sequences per second
        row = dict(context=n, batch=args.batch, dense_tok_s=tps["dense"], sparse_tok_s=tps["sparse"], ratio=ratio,
                   bound=b, bound_with_weights=bw, attended_fraction=frac, times=times)
        line = (f"{n:>8} {tps['dense']:>12.1f} {tps['sparse']:>13.1f} {ratio:>5.2f}x {b:>5.2f}x {bw:>7.2f}x "
                f"{frac:>9.3f}")
        for k in ("spec", "fr"):
            if k in runners:
                acc = runners[k].produced / runners[k].rounds
                row[f"{k}_tok_s"], row[f"{k}_acceptance"] = 1 / med[k], acc
                line += f" {1 / med[k]:>12.1f} {med['sparse'] / med[k]:>7.2f}x {acc:>5.2f}"
        rows.append(row)
        print(line, flush=True)
        del runners
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=args.checkpoint or args.config, batch=args.batch, rows=rows, steps=args.steps,
                           rounds=args.rounds, warmup=args.warmup, trained_length=spec_rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    from minicpm4_jax.config import ConfigError

    try:
        sys.exit(main())
    except ConfigError as e:  # a bad preset, override or run: one line, no traceback
        sys.exit(f"error: {e}")
