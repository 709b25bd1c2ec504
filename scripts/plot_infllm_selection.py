"""Render the InfLLM v2 block selection of one attention layer as a PNG (query token x KV block).

One panel per KV head; a cell is coloured when the query token attends the block in stage 2:
top-k picks (and, for gen-1, the in-kernel local window in a second colour); the causal boundary is
drawn for reference. Selection is the project's reference (``minicpm4_jax.infllm``, spec §5.2-§5.5).

Inputs (one of):
  --npz FILE    arrays ``q`` ``[T, heads, head_dim]`` (or ``[1, T, ...]``) and ``k``
                ``[T, kv_heads, head_dim]``: post-RoPE queries/keys of the layer you want to look at
                (e.g. dumped from a forward pass).
  --random T    synthetic inputs (``--heads``, ``--kv-heads``, ``--head-dim``) with a few "topic"
                directions so the top-k picks have structure.
  --checkpoint RUN --text FILE [--layer N] [--tokens T]
                a trained model (a run's ``out_dir``; its ``tokenizer/`` folder and sparse_config are
                used): the first T tokens of FILE, selection inputs of decoder layer N (pre-RoPE when
                ``use_nope``).

Selection settings come from ``--config`` (a YAML preset with ``model.sparse_config``) or the flags
(``--variant``, ``--topk``, ``--window``, ``--block-size``, ...); ``dense_len`` is ignored (the
sparse selection is always computed).

Example:
  python scripts/plot_infllm_selection.py --random 4096 --out selection.png

matplotlib is imported lazily (``pip install matplotlib``; not a project dependency).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np


def _sparse_cfg(args):
    from minicpm4_jax.config import SparseConfig, load_config

    if args.config:
        cfg = load_config(args.config).model.sparse_config
        if cfg is None:
            sys.exit(f"{args.config} has no model.sparse_config section")
        return cfg
    from minicpm4_jax.infllm import select_params

    cfg = SparseConfig(kernel_size=args.kernel_size, kernel_stride=args.kernel_stride, block_size=args.block_size,
                       init_blocks=args.init_blocks, window_size=args.window, topk=args.topk, variant=args.variant,
                       dense_len=-1)
    try:
        select_params(cfg)
    except ValueError as e:  # geometry that does not fit (--block-size, --kernel-size/--kernel-stride, --window,
        # gen2's --topk against --init-blocks)
        sys.exit(f"error: {e} (--block-size, --kernel-size, --kernel-stride, --window, --topk, --init-blocks)")
    return cfg


def _checkpoint_inputs(args):
    """(q, k, sparse_cfg) of one layer of a trained model on the first ``--tokens`` tokens of ``--text``."""
    from pathlib import Path

    import jax.numpy as jnp

    from minicpm4_jax.tokenizer import load_tokenizer
    from minicpm4_jax.train.checkpoint import find_checkpoint_dir, load_params_for_inference

    if not args.text:
        sys.exit("--checkpoint needs --text FILE (the input whose selection is drawn)")
    ckpt = find_checkpoint_dir(args.checkpoint)
    cfg, model = load_params_for_inference(ckpt)
    if args.layer >= cfg.model.num_hidden_layers:
        sys.exit(f"error: --layer {args.layer} is outside this model's layers 0..{cfg.model.num_hidden_layers - 1}")
    sc = _sparse_cfg(args) if args.config else cfg.model.sparse_config  # --config's geometry wins (helper 75)
    if sc is None:
        sys.exit(f"{args.checkpoint} was not trained with model.sparse_config; pass --config for the geometry")
    tok = load_tokenizer(str(next(p for p in (Path(args.checkpoint) / "tokenizer", ckpt.parent / "tokenizer")
                                  if p.is_dir())))
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))[: args.tokens]
    if len(ids) < args.tokens:
        print(f"note: {args.text} has only {len(ids)} tokens")
    q, k, _, q_nope, k_nope = model.layer_attention_inputs(jnp.asarray([ids], jnp.int32), args.layer)
    if sc.use_nope:
        q, k = q_nope, k_nope
    return np.asarray(q[0], np.float32), np.asarray(k[0], np.float32), sc


def _inputs(args):
    if args.npz:
        try:
            z = np.load(args.npz)
            q, k = np.asarray(z["q"], np.float32), np.asarray(z["k"], np.float32)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            sys.exit(f"error: cannot read --npz {args.npz}: {e}; give an .npz with arrays q [T, heads, d] and "
                     "k [T, kv_heads, d]")
        q = q[0] if q.ndim == 4 else q
        k = k[0] if k.ndim == 4 else k
        return q, k
    rng = np.random.default_rng(args.seed)
    t, nq, nkv, d = args.random, args.heads, args.kv_heads, args.head_dim
    topics = rng.standard_normal((8, d)).astype(np.float32)
    seg = rng.integers(0, 8, size=(t // 256 + 1,)).repeat(256)[:t]  # topic per 256-token segment
    k = rng.standard_normal((t, nkv, d)).astype(np.float32) + 2.0 * topics[seg][:, None, :]
    q = rng.standard_normal((t, nq, d)).astype(np.float32) + 2.0 * topics[rng.integers(0, 8, size=t)][:, None, :]
    return q, k


def selection_image(q: np.ndarray, k: np.ndarray, sparse_cfg, *, kernel_offby1_quirk: bool = False):
    """Per-KV-head selection grids.

    Args:
        q: ``[T, heads, head_dim]``; k: ``[T, kv_heads, head_dim]`` (one sequence, positions 0..T-1).
        sparse_cfg: :class:`~minicpm4_jax.config.SparseConfig`.

    Returns:
        (``grid`` uint8 ``[kv_heads, T, NB]``: 0 = not attended, 1 = top-k pick, 2 = gen-1 window block;
        ``counts`` int ``[kv_heads, T]``).
    """
    import jax.numpy as jnp

    from minicpm4_jax.infllm import select_blocks, select_params, selection_block_mask

    p = select_params(sparse_cfg, kernel_offby1_quirk=kernel_offby1_quirk)
    t = q.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    sel = select_blocks(jnp.asarray(q)[None], jnp.asarray(k)[None], q_positions=pos, params=p)
    nb = -(-t // p.block_size)
    picks = np.asarray(selection_block_mask(sel.topk_idx, q_positions=pos, num_blocks=nb, block_size=p.block_size))[0]
    grid = picks.astype(np.uint8)
    if p.variant == "gen1":
        allm = np.asarray(selection_block_mask(sel.topk_idx, q_positions=pos, num_blocks=nb, block_size=p.block_size,
                                               window_blocks=p.local_blocks))[0]
        grid = np.where(allm & ~picks, 2, grid).astype(np.uint8)
    return grid, np.asarray(sel.counts)[0]


def attended_share(mask: np.ndarray, block_size: int) -> float:
    """Attended visible keys / causal keys, summed over queries, for a ``[T, NB]`` block mask (positions 0..T-1).

    Block ``b`` holds ``min(block_size, max(0, t - b * block_size + 1))`` keys visible to query ``t``, so the
    current block counts only its past and present tokens (the share never exceeds 1).
    """
    t, nb = mask.shape
    vis = np.clip(np.arange(t)[:, None] - np.arange(nb)[None, :] * block_size + 1, 0, block_size)
    return float((mask * vis).sum() / max(1, (np.arange(t) + 1).sum()))


def plot(grid: np.ndarray, out: str, *, title: str, block_size: int) -> None:
    """Write ``grid`` (from :func:`selection_image`) to ``out`` as a PNG, one panel per KV head."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        sys.exit("matplotlib is needed for this script: pip install matplotlib")
    nkv, t, nb = grid.shape
    fig, axes = plt.subplots(1, nkv, figsize=(4.5 * nkv, 5), squeeze=False)
    cmap = ListedColormap(["white", "tab:blue", "tab:orange"])
    for h, ax in enumerate(axes[0]):
        ax.imshow(grid[h], aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=2,
                  extent=(-0.5, nb - 0.5, t - 0.5, -0.5))
        tt = np.arange(t)
        ax.plot(tt // block_size, tt, color="black", lw=0.5, alpha=0.6)  # causal boundary (current block)
        frac = attended_share(grid[h].astype(bool), block_size)
        ax.set_title(f"KV head {h}: {frac:.0%} of all causal keys")
        ax.set_xlabel("KV block")
        ax.set_ylabel("query token")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range

    GEOMETRY = "geometry for --random / --npz (a --checkpoint uses its own sparse_config, --config a preset's)"

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--npz", help="file with arrays q [T, heads, d] and k [T, kv_heads, d] of one layer")
    src.add_argument("--random", type=int_range(1), metavar="T", help="synthetic inputs of T tokens")
    src.add_argument("--checkpoint", metavar="RUN", help="a trained run (out_dir) to draw one layer of")
    ap.add_argument("--text", help="with --checkpoint: the input text file")
    ap.add_argument("--layer", type=int_range(0), default=0, help="with --checkpoint: decoder layer (0-based)")
    ap.add_argument("--tokens", type=int_range(1), default=1536, help="with --checkpoint: tokens of --text to use")
    ap.add_argument("--out", default="infllm_selection.png", help="PNG file to write")
    ap.add_argument("--config", help="YAML preset whose model.sparse_config is used")
    ap.add_argument("--variant", default="gen2", choices=["gen1", "gen2"], help="InfLLM v2 generation; " + GEOMETRY)
    ap.add_argument("--topk", type=int_range(1), default=64, help="selected blocks per query; " + GEOMETRY)
    ap.add_argument("--window", type=int_range(0), default=2048, help="local window (tokens); " + GEOMETRY)
    ap.add_argument("--block-size", type=int_range(1), default=64, help="selection block (tokens); " + GEOMETRY)
    ap.add_argument("--kernel-size", type=int_range(1), default=32, help="compression kernel (tokens); " + GEOMETRY)
    ap.add_argument("--kernel-stride", type=int_range(1), default=16, help="compression stride (tokens); " + GEOMETRY)
    ap.add_argument("--init-blocks", type=int_range(0), default=1, help="initial blocks always selected; " + GEOMETRY)
    ap.add_argument("--quirk", action="store_true", help="official stage-1 off-by-one (spec §5.2)")
    ap.add_argument("--heads", type=int_range(1), default=8, help="with --random: query heads")
    ap.add_argument("--kv-heads", type=int_range(1), default=2, help="with --random: KV heads (divides --heads)")
    ap.add_argument("--head-dim", type=int_range(1), default=64, help="with --random: head dimension")
    ap.add_argument("--seed", type=int_range(0), default=0, help="with --random: seed of the inputs")
    args = ap.parse_args(argv)
    if args.random and args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    for flag, path in (("--text", args.text), ("--npz", args.npz)):
        if path is not None and not Path(path).is_file():  # before a checkpoint is loaded
            ap.error(f"{flag} {path} is not a file; give the path of an existing file")
    if args.checkpoint:
        q, k, cfg = _checkpoint_inputs(args)
        cfg = dataclasses.replace(cfg, dense_len=-1)
    else:
        cfg = _sparse_cfg(args)
        q, k = _inputs(args)
    grid, counts = selection_image(q, k, cfg, kernel_offby1_quirk=args.quirk)
    src = f"{args.checkpoint} layer {args.layer}\n" if args.checkpoint else ""
    title = (f"InfLLM v2 {src}{cfg.variant}: T={q.shape[0]}, topk={cfg.topk}, window={cfg.window_size}, "
             f"block={cfg.block_size}, mean picks/token={counts.mean():.1f}")
    plot(grid, args.out, title=title, block_size=cfg.block_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from minicpm4_jax.config import ConfigError

    try:
        main()
    except ConfigError as e:  # a bad preset, override or run: one line, no traceback
        sys.exit(f"error: {e}")
