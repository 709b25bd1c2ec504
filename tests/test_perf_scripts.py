"""The decode benchmark script (``scripts/bench_decode.py``, issue 9) runs end to end on a tiny model.

It checks the script, not speed: every row carries positive tokens/s for both paths, and the sparse path
really selected blocks (attended fraction below 1, a bound above 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
model:
  vocab_size: 64
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 2
  num_attention_heads: 2
  num_key_value_heads: 1
  max_position_embeddings: 512
  dim_model_base: 16
  dtype: float32
  sparse_config: {kernel_size: 32, kernel_stride: 16, block_size: 32, window_size: 64, topk: 4, dense_len: 128}
data:
  tokenizer_vocab_size: 64
"""


def test_bench_decode_runs_dense_and_sparse(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_decode
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out.json"
    assert bench_decode.main(["--config", str(cfg), "--lengths", "256", "--steps", "2", "--rounds", "1",
                              "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 256 and row["dense_tok_s"] > 0 and row["sparse_tok_s"] > 0 and row["ratio"] > 0
    assert 0 < row["attended_fraction"] < 1 and row["bound"] > 1  # 256 >= dense_len: the sparse path selects
    # two sequences per step: the weights' share of the bound halves, so it moves towards the KV-only bound
    assert bench_decode.main(["--config", str(cfg), "--lengths", "256", "--steps", "2", "--rounds", "1",
                              "--batch", "2", "--json", str(out)]) == 0
    (row2,) = json.loads(out.read_text())["rows"]
    assert row2["batch"] == 2 and row2["dense_tok_s"] > 0 and row2["sparse_tok_s"] > 0
    assert row["bound_with_weights"] < row2["bound_with_weights"] < row2["bound"] == row["bound"]
    # no lengths and no checkpoint: nothing to measure, one line (exit 2) instead of a crash on max([])
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--config", str(cfg), "--lengths"])
    assert e.value.code == 2


def test_bench_dense_attention_runs(tmp_path, capsys):
    """``scripts/bench_dense_attention.py`` times both programs and reports their memory; bad shapes are one line."""
    import pytest

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_dense_attention
    finally:
        sys.path.pop(0)
    out = tmp_path / "r.json"
    assert bench_dense_attention.main(["--shape", "2,40,4,2,16", "--repeats", "1", "--block-q", "8", "--block-k", "16",
                                       "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["shape"]["T"] == 40 and r["time_ratio"] > 0
    assert r["reference"]["temp_bytes"] > 0 and r["blockwise"]["temp_bytes"] > 0
    assert "2,40,4,2,16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench_dense_attention.main(["--shape", "2,40,3,2,16"])
    assert e.value.code == 2
    assert "heads a multiple of kv_heads" in capsys.readouterr().err


def test_bench_decode_checkpoint_without_a_draft_head_is_one_line(monkeypatch):
    """``--checkpoint`` of a run trained without ``model.mtp`` failed with ``AttributeError: 'MiniCPM4' object has no
    attribute 'mtp'`` after loading it; now a ConfigError naming the run and the fix (one ``error:`` line)."""
    import pytest
    from flax import nnx

    import minicpm4_jax.train.checkpoint as ckpt
    from minicpm4_jax.config import ConfigError, load_config
    from minicpm4_jax.nn import MiniCPM4

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_decode
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    tcfg = load_config(None, ["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
                              "model.num_hidden_layers=1", "model.num_attention_heads=2",
                              "model.num_key_value_heads=1", "model.dim_model_base=16", "model.mtp=false",
                              "data.tokenizer_vocab_size=64"])
    monkeypatch.setattr(ckpt, "find_checkpoint_dir", lambda run: run)
    monkeypatch.setattr(ckpt, "load_params_for_inference", lambda d: (tcfg, MiniCPM4(tcfg.model, rngs=nnx.Rngs(0))))
    with pytest.raises(ConfigError, match=r"runs/plain was trained without its MTP draft head \(model.mtp=false\)"):
        bench_decode.trained_length_spec("runs/plain", 3, None, 16, 8, 2, 1)
