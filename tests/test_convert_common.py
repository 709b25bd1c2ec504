"""Shared helpers for the checkpoint-interchange tests (issue 7); holds no tests itself.

Tiny float32 configs that exercise every branch (GQA, tied and untied heads, distinct per-frequency
LongRoPE factors, max positions equal to and above the original length), random parameters with
non-unit norm weights, a tiny SentencePiece tokenizer trained in about a second, and the jitted
JAX forward used as the reference everywhere.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minicpm4_jax.config import ModelConfig, RopeScalingConfig, SparseConfig, validate_model
from minicpm4_jax.convert import flat_params
from minicpm4_jax.nn.model import MiniCPM4

ORIG = 64  # original_max_position_embeddings of the tiny configs


def factors(n: int) -> tuple[float, ...]:
    """Distinct per-frequency LongRoPE divisors 1..8 (slightly irregular)."""
    base = np.geomspace(1.0, 8.0, n) * (1.0 + 0.01 * np.sin(np.arange(n) * 1.7))
    return tuple(float(x) for x in base)


def tiny_cfg(*, tied: bool = True, vocab: int = 320, hidden: int = 64, heads: int = 4, kv: int = 2, layers: int = 2,
             inter: int = 96, max_pos: int = ORIG, scale_emb: float = 7.0, scale_depth: float = 1.9,
             dim_model_base: int = 16, sparse: bool = False, eos=(2,)) -> ModelConfig:
    """A tiny MiniCPM4 (head_dim = hidden/heads, every matrix row a multiple of 32 for Q8_0)."""
    d = hidden // heads
    f = factors(d // 2)
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=RopeScalingConfig(f, f, ORIG), tie_word_embeddings=tied,
        scale_emb=scale_emb, scale_depth=scale_depth, dim_model_base=dim_model_base, initializer_range=0.2,
        eos_token_id=tuple(eos), dtype="float32", param_dtype="float32",
        attention="infllmv2" if sparse else "dense",
        sparse_config=SparseConfig(kernel_size=32, kernel_stride=16, block_size=64, window_size=128, topk=4,
                                   dense_len=-1) if sparse else None,
    )
    validate_model(cfg)
    return cfg


def random_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random μP-initialised float32 params (flat ``'/'``-keyed), norms × U(0.5, 1.5)."""
    model = MiniCPM4(cfg, rngs=nnx.Rngs(seed))
    flat = {k: np.array(v) for k, v in flat_params(model).items()}
    r = np.random.default_rng(seed)
    for k in flat:
        if k.endswith("norm") or k.endswith("layernorm"):
            flat[k] = (flat[k] * r.uniform(0.5, 1.5, flat[k].shape)).astype(np.float32)
    return flat


def model_from_flat(cfg: ModelConfig, flat: dict[str, np.ndarray]) -> MiniCPM4:
    """A :class:`MiniCPM4` holding ``flat`` (checks the key set)."""
    model = MiniCPM4(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)
    have = set(flat_params(model))
    assert have == set(flat), (sorted(have ^ set(flat)))
    for k, v in flat.items():
        d = pure
        *head, last = k.split("/")
        for part in head:
            d = d[part]
        d[last] = jnp.asarray(v)
    nnx.replace_by_pure_dict(params, pure)
    nnx.update(model, params)
    return model


def jax_logits(cfg: ModelConfig, flat: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """float32 logits ``[batch, seq, vocab]`` of our model with ``flat`` params (jitted)."""
    model = model_from_flat(cfg, flat)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    return np.asarray(fwd(state, jnp.asarray(ids, jnp.int32)))


def greedy(cfg: ModelConfig, flat: dict[str, np.ndarray], prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (our reference generation path, no stop ids)."""
    from minicpm4_jax.generate import generate_ids

    return generate_ids(model_from_flat(cfg, flat), list(prompt), n, temperature=0.0)


def _corpus(seed: int = 0, n_lines: int = 600) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "data", "import", "class", "for", "in", "if", "else", "print",
             "x", "y", "0", "1", "42", "None", "(", ")", ":", "=", "+", "你好", "name", "range", "len"]
    docs, lines = [], []
    for i in range(n_lines):
        lines.append(rng.choice(["", "    ", "\t"]) + " ".join(rng.choice(words) for _ in range(rng.randrange(2, 9))))
        if i % 100 == 99:
            docs.append("\n".join(lines) + "\n")
            lines = []
    return docs


def make_tokenizer_dir(root: Path, vocab: int = 320) -> Path:
    """A tiny trained SentencePiece BPE tokenizer (``vocab`` ids) saved like a training run's ``tokenizer/``."""
    from minicpm4_jax.tokenizer import train_tokenizer

    tok = train_tokenizer(_corpus(), vocab, root / "spm-cache", log=lambda s: None)
    out = root / "tokenizer"
    tok.save(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """Session-wide tiny tokenizer folder (320 ids: unk 0, bos 1, eos 2)."""
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A tiny run trained here (4 float32 steps, its own 320-id tokenizer; a few seconds): the data pipeline joined
    its documents with EOS, so its ``document_start`` is ``eos``. Read only: copy it to change it."""
    from minicpm4_jax.config import load_config
    from minicpm4_jax.train.loop import run_training

    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(_corpus()):
        (corpus / f"doc{i:03d}.txt").write_text(doc)
    ov = {"model.vocab_size": 320, "model.hidden_size": 64, "model.intermediate_size": 96,
          "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
          "model.max_position_embeddings": 128, "model.dim_model_base": 16, "model.dtype": "float32",
          "data.sources": f"[{corpus}]", "data.tokenizer_vocab_size": 320, "data.seq_len": 32, "data.batch_size": 4,
          "data.cache_dir": str(root / "cache"), "steps": 4, "optimizer.warmup_steps": 1,
          "optimizer.decay_steps": 1, "optimizer.learning_rate": 0.02, "log_every": 2, "eval_every": 4,
          "eval_batches": 1, "checkpoint.save_every": 4, "out_dir": str(root / "run"), "sample_tokens": 0,
          "tensorboard": False}
    run_training(load_config(None, [f"{k}={v}" for k, v in ov.items()]), log=lambda s: None, progress=False)
    return root / "run"


def read_json(p: Path) -> dict:
    return json.loads(Path(p).read_text())


def fold_official_dir_in_test(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Fold an official-layout folder into a ``LlamaForCausalLM`` (tensors, config) with plain numpy.

    Independent of ``llama_fold``: reads the μP scalars from the exported ``config.json`` itself
    (embed × scale_emb; o_proj/down_proj × scale_depth/sqrt(L); lm_head (or the tied embedding) ÷
    (hidden/dim_model_base)), so a wrong scalar or name in the export shows as a logit mismatch.
    """
    from safetensors import safe_open

    hf = read_json(folder / "config.json")
    tensors: dict[str, np.ndarray] = {}
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for fn in files:
        with safe_open(str(folder / fn), framework="np") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k).astype(np.float64)
    L = hf["num_hidden_layers"]
    res = hf["scale_depth"] / np.sqrt(L)
    width = hf["hidden_size"] / hf["dim_model_base"]
    out = {}
    for k, v in tensors.items():
        if k == "model.embed_tokens.weight":
            out[k] = v * hf["scale_emb"]
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k] = v * res
        elif k == "lm_head.weight":
            out[k] = v / width
        else:
            out[k] = v
    if "lm_head.weight" not in tensors:
        assert hf["tie_word_embeddings"] is True
        out["lm_head.weight"] = tensors["model.embed_tokens.weight"] / width
    out = {k: np.ascontiguousarray(v.astype(np.float32)) for k, v in out.items()}
    cfg = {k: v for k, v in hf.items() if k not in ("scale_emb", "scale_depth", "dim_model_base", "sparse_config")}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False, torch_dtype="float32")
    return out, cfg


# ------------------------------------------------------------------------------------------------
# staged outputs killed midway (third break test: a killed export left its staging folder behind for good)
# ------------------------------------------------------------------------------------------------

_STAGE_WORKER = r"""
import sys, time
from pathlib import Path
from minicpm4_jax.convert.io import staged_output
with staged_output(sys.argv[1], force=True) as stage:
    (stage / "model.safetensors").write_bytes(b"x" * 1000)
    print("WRITING", flush=True)
    time.sleep(60)
"""


def _start_stage_worker(out: Path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STAGE_WORKER, str(out)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.readline().strip() == "WRITING"
    return proc


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "over_an_earlier_output"])
def test_sigterm_during_a_staged_output_leaves_nothing_behind(tmp_path, earlier):
    import signal

    out = tmp_path / "o"
    if earlier:
        out.mkdir()
        (out / "minicpm4_manifest.json").write_text("{}")
    proc = _start_stage_worker(out)
    assert any(".o.partial-" in n for n in _hidden(tmp_path))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _hidden(tmp_path) == []
    assert out.exists() == earlier and (not earlier or [p.name for p in out.iterdir()] == ["minicpm4_manifest.json"])


def test_the_next_run_removes_what_a_sigkill_left_and_restores_a_moved_aside_output(tmp_path):
    import signal

    from minicpm4_jax.convert.io import recover_interrupted, staged_output

    out = tmp_path / "o"
    proc = _start_stage_worker(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = _hidden(tmp_path)
    assert len(left) == 2 and left[0].startswith(".o.partial-") and left[1].endswith(".owner"), left
    said = []
    with staged_output(out) as stage:
        (stage / "a").write_text("new")
    assert _hidden(tmp_path) == [] and (out / "a").read_text() == "new"
    # a --force run killed between moving the previous output aside and renaming the new one into place
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a").write_text("previous")
    (tmp_path / ".p.old-0123abcd").mkdir()
    (tmp_path / ".p.old-0123abcd" / "a").write_text("moved aside")
    (tmp_path / "p").rename(tmp_path / "gone")
    recover_interrupted(tmp_path / "p", log=said.append)
    assert (tmp_path / "p" / "a").read_text() == "moved aside" and not (tmp_path / ".p.old-0123abcd").exists()
    assert len(said) == 1 and said[0].startswith(f"restored {tmp_path / 'p'} from "), said
    # a staging folder whose owner is alive (this process) is left alone
    live = tmp_path / ".q.partial-00000000"
    live.mkdir()
    import os
    import socket

    (tmp_path / ".q.partial-00000000.owner").write_text(f"{socket.gethostname()} {os.getpid()}\n")
    recover_interrupted(tmp_path / "q", log=said.append)
    assert live.is_dir() and len(said) == 1


def test_recovery_matches_only_its_own_out_name_and_a_mount_point_out_is_refused(tmp_path, monkeypatch):
    """The re-break test: an --out named 'ckpt[a]' globbed '.ckpt[a].partial-*' as a pattern, so it removed ckpta's
    staging folder and restored ckpta's moved-aside output under its own name; and an --out that is a mount point
    ran the whole export, then failed to rmdir/rename it (EBUSY)."""
    import os

    from minicpm4_jax.convert.io import ConvertError, check_output_target, recover_interrupted

    for n in (".ckpta.partial-cafe0001", ".ckpta.old-deadbeef"):
        (tmp_path / n).mkdir()
        os.utime(tmp_path / n, (0, 0))  # old enough to count as dead
    said = []
    recover_interrupted(tmp_path / "ckpt[a]", log=said.append)
    assert said == [] and _hidden(tmp_path) == [".ckpta.old-deadbeef", ".ckpta.partial-cafe0001"]
    (tmp_path / ".ckpt[a].partial-00000001").mkdir()
    os.utime(tmp_path / ".ckpt[a].partial-00000001", (0, 0))
    recover_interrupted(tmp_path / "ckpt[a]", log=said.append)
    assert len(said) == 1 and not (tmp_path / ".ckpt[a].partial-00000001").exists()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt)
    with pytest.raises(ConvertError, match=f"--out {mnt} is a mount point, .* e.g. --out {mnt / 'model'}"):
        check_output_target(mnt, force=False)
