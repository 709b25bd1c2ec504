"""Hugging Face import/export (issue 7): round trips, official tables, manifests, bad input, CLI.

No torch here: the transformers checks are in ``test_export_transformers.py``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import shared_path
from test_convert_common import random_params, read_json, tiny_cfg, tiny_tokenizer_dir, trained_run  # noqa: F401

from minicpm4_jax.cli import main
from minicpm4_jax.config import ModelConfig, load_config
from minicpm4_jax.convert import flat_params, official_config, official_param_shapes, unfold_from_llama
from minicpm4_jax.convert.hf_export import write_hf
from minicpm4_jax.convert.hf_import import import_hf, read_hf_config
from minicpm4_jax.convert.io import MANIFEST_NAME, ConvertError, SafetensorsSource, params_sha256
from minicpm4_jax.train.checkpoint import load_params_for_inference


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"{k}: not bit-identical"


def _no_leftovers(parent: Path) -> None:
    left = [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    assert not left, f"staging folders left behind: {left}"


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied,shard", [(True, "4KB"), (False, "5GB")])
def test_official_layout_round_trip_is_bit_identical(tmp_path, tiny_tokenizer_dir, tied, shard):
    cfg = tiny_cfg(tied=tied)
    params = random_params(cfg, seed=1 if tied else 2)
    res = write_hf(params, cfg, tmp_path / "hf", layout="minicpm", dtype="float32",
                   tokenizer_dir=tiny_tokenizer_dir, max_shard_size=shard)
    hf = tmp_path / "hf"
    names = set(official_param_shapes(cfg))
    assert ("lm_head.weight" in names) is (not tied)
    if shard == "4KB":  # sharded: a valid index whose total_size is the tensor bytes
        index = read_json(hf / "model.safetensors.index.json")
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert set(index["weight_map"]) == names
        assert index["metadata"]["total_size"] == sum(4 * int(np.prod(s)) for s in official_param_shapes(cfg).values())
        assert not (hf / "model.safetensors").exists()
    else:
        assert (hf / "model.safetensors").is_file() and not (hf / "model.safetensors.index.json").exists()
    with SafetensorsSource(hf) as src:
        assert {n: e.shape for n, e in src.entries.items()} == official_param_shapes(cfg)
        assert {e.dtype for e in src.entries.values()} == {"F32"}
    for f in ("config.json", "generation_config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
              MANIFEST_NAME):
        assert (hf / f).is_file(), f
    man = read_json(hf / MANIFEST_NAME)
    assert man["format"] == "hf-minicpm" and man["dtype"] == "float32" and man["folded"] == []
    assert set(man["files"]) >= {"config.json", "tokenizer.model"} and res.path == hf

    imp = import_hf(hf, tmp_path / "run")
    _assert_bit_identical(flat_params(imp.params), params)
    assert imp.cfg == cfg
    # the import is a checkpoint this project reads back (generate / export use this path), verified against
    # the checksums saved with it
    assert (tmp_path / "run" / "checkpoints" / "0" / "checksums").is_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "loaded unverified" warning
        train_cfg, model = load_params_for_inference(tmp_path / "run")
    assert train_cfg.model == cfg
    _assert_bit_identical(flat_params(model), params)
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.model").is_file()
    man = read_json(tmp_path / "run" / MANIFEST_NAME)
    assert man["params_sha256"] == params_sha256(params)
    _no_leftovers(tmp_path)


def test_bf16_export_rounds_once_and_bf16_values_round_trip(tmp_path):
    cfg = tiny_cfg(tied=False)
    params = random_params(cfg, seed=3)
    write_hf(params, cfg, tmp_path / "a", dtype="bfloat16", no_tokenizer=True)
    with SafetensorsSource(tmp_path / "a") as src:
        assert {e.dtype for e in src.entries.values()} == {"BF16"}
    got = flat_params(import_hf(tmp_path / "a", tmp_path / "ra", no_tokenizer=True).params)
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in params.items()}
    _assert_bit_identical(got, rounded)  # one round-to-nearest-even, nothing else
    assert any(not np.array_equal(rounded[k], params[k]) for k in params)  # the rounding is real
    # parameters that already hold bf16 values survive a bf16 export exactly
    write_hf(rounded, cfg, tmp_path / "b", dtype="bfloat16", no_tokenizer=True)
    _assert_bit_identical(flat_params(import_hf(tmp_path / "b", tmp_path / "rb", no_tokenizer=True).params), rounded)


def test_llama_layout_folds_and_unfolds_within_rounding(tmp_path):
    """The Llama layout is not lossless (x*s/s in float32): its inverse is within 1e-6 relative."""
    cfg = tiny_cfg(tied=True)
    params = random_params(cfg, seed=4)
    res = write_hf(params, cfg, tmp_path / "l", layout="llama", no_tokenizer=True)
    hf = read_json(tmp_path / "l" / "config.json")
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is False
    for k in ("scale_emb", "scale_depth", "dim_model_base", "sparse_config"):
        assert k not in hf
    with SafetensorsSource(tmp_path / "l") as src:
        tensors = {k: src.get(k) for k in src.entries}
    assert "lm_head.weight" in tensors
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"],
                                  (params["embed_tokens/embedding"].astype(np.float64) * 7.0).astype(np.float32))
    back = unfold_from_llama(tensors, cfg)
    for k in params:
        np.testing.assert_allclose(back[k], params[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert len(res.manifest["folded"]) == 3 and res.manifest["format"] == "hf-llama"


def test_import_places_params_on_a_mesh(tmp_path):
    """With target shardings, every parameter lands on the mesh with the requested sharding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = tiny_cfg(tied=False)
    params = random_params(cfg, seed=5)
    write_hf(params, cfg, tmp_path / "hf", max_shard_size="8KB", no_tokenizer=True)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))

    def shard(path: str, shape: tuple[int, ...]):
        spec = [None] * len(shape)
        if len(shape) >= 2 and shape[-1] % 2 == 0:
            spec[-1] = "tensor"
        if shape[0] % 4 == 0 and len(shape) >= 2:
            spec[0] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    imp = import_hf(tmp_path / "hf", tmp_path / "run", shardings=shard, no_tokenizer=True)
    flat_arrays = {"/".join(map(str, p)): v.get_value() for p, v in __import__("flax").nnx.to_flat_state(imp.params)}
    for k, a in flat_arrays.items():
        assert a.sharding == shard(k, a.shape), k
        assert len(a.sharding.device_set) == 8
    _assert_bit_identical({k: np.asarray(v) for k, v in flat_arrays.items()}, params)


# ------------------------------------------------------------------------------------------------
# official layout vs the released tables (spec minicpm4_model.md §6)
# ------------------------------------------------------------------------------------------------

#: spec §6: name -> (8B shape, 0.5B shape); per-layer names with {i}
SPEC_TABLE = {
    "model.embed_tokens.weight": ((73448, 4096), (73448, 1024)),
    "model.layers.{i}.input_layernorm.weight": ((4096,), (1024,)),
    "model.layers.{i}.self_attn.q_proj.weight": ((4096, 4096), (1024, 1024)),
    "model.layers.{i}.self_attn.k_proj.weight": ((256, 4096), (128, 1024)),
    "model.layers.{i}.self_attn.v_proj.weight": ((256, 4096), (128, 1024)),
    "model.layers.{i}.self_attn.o_proj.weight": ((4096, 4096), (1024, 1024)),
    "model.layers.{i}.post_attention_layernorm.weight": ((4096,), (1024,)),
    "model.layers.{i}.mlp.gate_proj.weight": ((16384, 4096), (4096, 1024)),
    "model.layers.{i}.mlp.up_proj.weight": ((16384, 4096), (4096, 1024)),
    "model.layers.{i}.mlp.down_proj.weight": ((4096, 16384), (1024, 4096)),
    "model.norm.weight": ((4096,), (1024,)),
    "lm_head.weight": ((73448, 4096), None),  # 0.5B: tied, not stored
}


def _spec_shapes(col: int, layers: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shapes in SPEC_TABLE.items():
        if shapes[col] is None:
            continue
        for i in range(layers) if "{i}" in name else [None]:
            out[name.format(i=i)] = shapes[col]
    return out


def test_official_key_set_and_shapes_equal_released_05b():
    released = ModelConfig.from_hf_config(read_json(shared_path("data", "minicpm4-0.5b", "config.json")))
    shapes = official_param_shapes(released)
    assert shapes == _spec_shapes(1, 24)
    assert len(shapes) == 24 * 9 + 2 and "lm_head.weight" not in shapes


@pytest.mark.parametrize("preset", ["minicpm4_8b", "minicpm41_8b"])
def test_official_key_set_and_shapes_equal_8b_table(preset):
    shapes = official_param_shapes(load_config(preset).model)
    assert shapes == _spec_shapes(0, 32)
    assert len(shapes) == 32 * 9 + 3


def test_official_config_reproduces_released_05b_config(tmp_path):
    raw = read_json(shared_path("data", "minicpm4-0.5b", "config.json"))
    cfg = ModelConfig.from_hf_config(raw)
    out = official_config(cfg, "bfloat16")
    loader_only = {"auto_map", "_name_or_path", "transformers_version", "use_cache"}
    diffs = {k: (raw[k], out.get(k, "<missing>")) for k in raw if k not in loader_only and out.get(k) != raw[k]}
    assert not diffs, diffs
    assert "factor" not in out["rope_scaling"] and "sparse_config" not in out
    assert out["tie_word_embeddings"] is True  # written explicitly (the released file relies on the default)
    # the importer reads the released config.json itself to the same model
    (tmp_path / "config.json").write_text(json.dumps(raw))
    _, cfg2, warns = read_hf_config(tmp_path)
    assert cfg2 == ModelConfig.from_hf_config(raw, dtype="float32", param_dtype="float32") and warns == []


# ------------------------------------------------------------------------------------------------
# export from a checkpoint + CLI + manifests
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def imported_run(tmp_path, tiny_tokenizer_dir):
    """A run folder made by ``minicpm4 import hf`` from an official export of random params."""
    cfg = tiny_cfg(tied=True)
    params = random_params(cfg, seed=6)
    write_hf(params, cfg, tmp_path / "src", tokenizer_dir=tiny_tokenizer_dir)
    rc = main(["import", "hf", str(tmp_path / "src"), "--out", str(tmp_path / "run")])
    assert rc == 0
    return tmp_path / "run", cfg, params


def test_cli_export_hf_from_checkpoint_records_provenance(imported_run, tmp_path, capsys):
    run, cfg, params = imported_run
    rc = main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "e1"), "--layout", "minicpm"])
    assert rc == 0, capsys.readouterr().err
    man = read_json(tmp_path / "e1" / MANIFEST_NAME)
    assert man["source"]["step"] == 0 and man["source"]["params_sha256"] == params_sha256(params)
    assert man["source"]["checkpoint"].endswith("checkpoints")
    assert man["mtp_draft"].startswith("not exported")
    # the CLI export is the same bytes as exporting the params directly
    write_hf(params, cfg, tmp_path / "direct", no_tokenizer=True)
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "e1" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f
    # non-empty output: refused without --force (one line, exit 2), replaced with it
    capsys.readouterr()
    rc = main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "e1"), "--layout", "llama"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not empty" in err[0] and "--force" in err[0]
    assert read_json(tmp_path / "e1" / "config.json")["architectures"] == ["MiniCPMForCausalLM"]
    rc = main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "e1"), "--layout", "llama", "--force",
               "--dtype", "bfloat16"])
    assert rc == 0
    assert read_json(tmp_path / "e1" / "config.json")["architectures"] == ["LlamaForCausalLM"]
    man = read_json(tmp_path / "e1" / MANIFEST_NAME)
    assert man["format"] == "hf-llama" and man["dtype"] == "bfloat16" and len(man["folded"]) == 3
    assert set(man["files"]) == {p.name for p in (tmp_path / "e1").iterdir() if p.name != MANIFEST_NAME}
    _no_leftovers(tmp_path)


def test_cli_errors_are_one_line(tmp_path, imported_run, capsys):
    run, _, _ = imported_run
    cases = [
        (["import", "hf", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "is not a folder"),
        (["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "x"), "--layout", "gpt"], "--layout 'gpt'"),
        (["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "x"), "--dtype", "int8"], "--dtype 'int8'"),
        (["export", "gguf", "--checkpoint", str(run), "--out", str(tmp_path / "x"), "--outtype", "q4_k"], "'q4_k'"),
        (["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "x"), "--step", "7"], "--step 7"),
        (["export", "hf", "--checkpoint", str(run), "--out", str(run)], "overlaps the source"),
        (["export", "hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "does not exist"),
    ]
    for argv, needle in cases:
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and needle in err[0], (argv, err)
        assert not (tmp_path / "x").exists()
    _no_leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def official_dir(tmp_path, tiny_tokenizer_dir) -> tuple[Path, ModelConfig]:
    cfg = tiny_cfg(tied=False)
    write_hf(random_params(cfg, seed=7), cfg, tmp_path / "hf", tokenizer_dir=tiny_tokenizer_dir, max_shard_size="16KB")
    return tmp_path / "hf", cfg


def _edit_shard(folder: Path, edit) -> None:
    """Rewrite the shard files with ``edit(dict)`` applied and the index regenerated."""
    from safetensors.numpy import save_file

    with SafetensorsSource(folder) as src:
        tensors = {k: src.get(k) for k in src.entries}
    for p in folder.glob("model*.safetensors*"):
        p.unlink()
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("what,needle", [
    ("missing", "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    ("extra", "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    ("shape", "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64] but config.json implies [32, 64]"),
    ("dtype", "tensor 'model.norm.weight' is I32"),
])
def test_import_names_the_bad_tensor(official_dir, tmp_path, what, needle):
    folder, _ = official_dir

    def edit(t):
        if what == "missing":
            del t["model.layers.1.mlp.up_proj.weight"]
        elif what == "extra":
            t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"]
        elif what == "shape":
            t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
        else:
            t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)

    _edit_shard(folder, edit)
    with pytest.raises(ConvertError) as e:
        import_hf(folder, tmp_path / "out")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    _no_leftovers(tmp_path)


def test_import_rejects_truncated_and_inconsistent_files(official_dir, tmp_path):
    folder, _ = official_dir
    index = read_json(folder / "model.safetensors.index.json")
    shard = folder / sorted(set(index["weight_map"].values()))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ConvertError, match=rf"{shard.name} is truncated: .* \(100 missing\)"):
        import_hf(folder, tmp_path / "out")
    shard.write_bytes(data[:5])
    with pytest.raises(ConvertError, match="not even a safetensors header"):
        import_hf(folder, tmp_path / "out")
    shard.unlink()
    with pytest.raises(ConvertError, match=rf"to {shard.name}, which does not exist"):
        import_hf(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch,needle", [
    (["LlamaForCausalLM"], "a Llama-folded export"),
    (["MiniCPM3ForCausalLM"], "is not ['MiniCPMForCausalLM']"),
    (None, "architectures=[]"),
    # tenth-session break test: an EAGLE draft or a run folder got only "architectures=[] is not [...]"
    ("eagle", "an EAGLE draft folder: import it together with its base model, 'minicpm4 import hf BASE --eagle "),
    ("run", "a training run of this project: generate, eval and export take the run folder as it is"),
])
def test_import_rejects_wrong_architecture(official_dir, tmp_path, arch, needle):
    folder, _ = official_dir
    cfg = read_json(folder / "config.json")
    if arch in (None, "eagle"):
        cfg.pop("architectures")
        if arch == "eagle":
            cfg.update(num_hidden_layers=1, base_num_hidden_layers=2)
    elif arch == "run":  # a run's config.json is the TrainConfig (a "model" section), beside checkpoints/
        cfg = {"model": {"hidden_size": cfg["hidden_size"]}, "steps": 3}
        (folder / "checkpoints").mkdir()
    else:
        cfg["architectures"] = arch
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError) as e:
        import_hf(folder, tmp_path / "out")
    assert needle in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("drop", ["short_factor", "long_factor"])
def test_import_names_a_missing_rope_factor_list(official_dir, tmp_path, capsys, drop):
    folder, _ = official_dir
    cfg = read_json(folder / "config.json")
    del cfg["rope_scaling"][drop]
    (folder / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["import", "hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {folder / 'config.json'}: rope_scaling has no {drop!r}"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,needle", [
    # found by a break test: both printed a Python traceback (AttributeError on list.get / list.items)
    (lambda c: [1, 2], "config.json holds a JSON list, not an object"),
    (lambda c: {**c, "sparse_config": [1, 2]}, "sparse_config=[1, 2] is not a mapping"),
    (lambda c: {**c, "sparse_config": {"topk": "many"}}, "sparse_config.topk='many' must be an integer"),
    # third break test: imported silently, cast to another model (scale_emb true -> 1.0, 2.5 layers -> 2, "false" -> True)
    (lambda c: {**c, "scale_emb": True}, "scale_emb=True must be a number"),
    (lambda c: {**c, "num_hidden_layers": 2.5}, "num_hidden_layers=2.5 must be an integer"),
    (lambda c: {**c, "hidden_size": str(c["hidden_size"])}, "hidden_size='"),
    (lambda c: {**c, "rope_theta": "1e4"}, "rope_theta='1e4' is a string; config.json needs a JSON number"),
    (lambda c: {**c, "tie_word_embeddings": "false"}, "tie_word_embeddings='false' is a string; config.json needs"),
    (lambda c: {**c, "eos_token_id": [2, "x"]}, "eos_token_id[1]='x' must be an integer"),
])
def test_import_names_a_config_of_the_wrong_shape(official_dir, tmp_path, capsys, edit, needle):
    folder, _ = official_dir
    (folder / "config.json").write_text(json.dumps(edit(read_json(folder / "config.json"))))
    capsys.readouterr()
    assert main(["import", "hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_import_tied_model_with_redundant_head(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(tied=True)
    write_hf(random_params(cfg, seed=8), cfg, tmp_path / "hf", no_tokenizer=True)
    _edit_shard(tmp_path / "hf", lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    assert "lm_head.weight equals the embedding (tied head); ignored" in import_hf(tmp_path / "hf", tmp_path / "a", no_tokenizer=True).warnings
    _edit_shard(tmp_path / "hf", lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"] * 2))
    with pytest.raises(ConvertError, match='set "tie_word_embeddings": false'):
        import_hf(tmp_path / "hf", tmp_path / "b", no_tokenizer=True)


def test_vocabulary_mismatch_is_refused_both_ways(tmp_path, tiny_tokenizer_dir):
    cfg = tiny_cfg(vocab=300)  # the tokenizer has 320 ids
    params = random_params(cfg, seed=9)
    with pytest.raises(ConvertError, match=r"has 320 tokens but the model's vocab_size is 300"):
        write_hf(params, cfg, tmp_path / "e", tokenizer_dir=tiny_tokenizer_dir)
    assert not (tmp_path / "e").exists()
    write_hf(params, cfg, tmp_path / "hf", no_tokenizer=True)
    for n in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / n, tmp_path / "hf" / n)
    with pytest.raises(ConvertError, match=r"has 320 tokens but config.json has vocab_size 300"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_enough_disk_space_writes_nothing(tmp_path, monkeypatch):
    import minicpm4_jax.convert.io as cio

    cfg = tiny_cfg()
    params = random_params(cfg, seed=10)
    real = cio.shutil.disk_usage
    monkeypatch.setattr(cio.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(ConvertError, match=r"not enough disk space in .*: the output needs about [\d.]+ MiB, 1.0 MiB"):
        write_hf(params, cfg, tmp_path / "e", no_tokenizer=True)
    assert not (tmp_path / "e").exists()
    monkeypatch.setattr(cio.shutil, "disk_usage", real)
    write_hf(params, cfg, tmp_path / "hf", no_tokenizer=True)
    monkeypatch.setattr(cio.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(ConvertError, match="not enough disk space"):
        import_hf(tmp_path / "hf", tmp_path / "out", no_tokenizer=True)
    assert not (tmp_path / "out").exists()


def test_failure_mid_write_leaves_no_folder_and_keeps_the_old_one(tmp_path, monkeypatch):
    import minicpm4_jax.convert.hf_export as hx

    cfg = tiny_cfg()
    params = random_params(cfg, seed=11)
    write_hf(params, cfg, tmp_path / "e", no_tokenizer=True)
    before = (tmp_path / "e" / "model.safetensors").read_bytes()
    real = hx.write_safetensors_shards

    def crash(folder, tensors, plan):
        real(folder, tensors, plan[:1])  # writes the first shard, then "the disk fails"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hx, "write_safetensors_shards", crash)
    with pytest.raises(OSError):
        write_hf(params, cfg, tmp_path / "new", max_shard_size="8KB", no_tokenizer=True)
    assert not (tmp_path / "new").exists()
    with pytest.raises(OSError):
        write_hf(params, cfg, tmp_path / "e", max_shard_size="8KB", force=True, no_tokenizer=True)
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == before  # the old export is intact
    assert (tmp_path / "e" / MANIFEST_NAME).is_file()
    _no_leftovers(tmp_path)


def test_sparse_model_exports_with_warnings(tmp_path):
    cfg = tiny_cfg(sparse=True)
    params = random_params(cfg, seed=12)
    logged: list[str] = []
    res = write_hf(params, cfg, tmp_path / "m", layout="minicpm", log=logged.append, no_tokenizer=True)
    hf = read_json(tmp_path / "m" / "config.json")
    assert hf["sparse_config"]["kernel_size"] == 32 and hf["sparse_config"]["topk"] == 4
    assert any("GQA group size 2" in w and "groups of 16" in w for w in res.warnings)
    assert any("head_dim 16 is not 128" in w for w in res.warnings)
    assert all(line.startswith("warning: ") for line in logged) and len(logged) == len(res.warnings)
    # the import brings the sparse settings back
    assert import_hf(tmp_path / "m", tmp_path / "r", no_tokenizer=True).cfg.sparse_config == cfg.sparse_config
    # the dense-only llama layout: refused by default (tests/test_convert_errors.py), kept with allow_dense
    with pytest.raises(ConvertError, match="--allow-dense"):
        write_hf(params, cfg, tmp_path / "l", layout="llama", no_tokenizer=True)
    assert not (tmp_path / "l").exists()
    res = write_hf(params, cfg, tmp_path / "l", layout="llama", no_tokenizer=True, allow_dense=True)
    assert "sparse_config" not in read_json(tmp_path / "l" / "config.json")
    assert any("dense attention only" in w for w in res.warnings)
    assert read_json(tmp_path / "l" / MANIFEST_NAME)["dropped"] == ["sparse_config"]
    assert read_json(tmp_path / "l" / MANIFEST_NAME)["attention"] == "dense"
    assert read_json(tmp_path / "l" / MANIFEST_NAME)["allow_dense"] is True


def test_official_layout_with_a_head_dim_official_readers_cannot_load_warns(tmp_path):
    """Helper 101: a model whose head_dim is not hidden_size/num_attention_heads exported to the official layout
    without a word, though OpenBMB's remote code, CPM.cu and llama.cpp's convert_hf_to_gguf.py take the head width
    as hidden/heads (the converter failed with 'The length of rope long and short factors must be 8.0'). The export
    still works (its own remote code reads head_dim) and now says so; a head_dim equal to hidden/heads and the llama
    layout (transformers reads head_dim) stay quiet."""
    import dataclasses

    base = tiny_cfg(tied=False)
    rs = base.rope_scaling
    odd = dataclasses.replace(base, head_dim=8, rope_scaling=dataclasses.replace(
        rs, short_factor=rs.short_factor[:4], long_factor=rs.long_factor[:4]))
    logged: list[str] = []
    res = write_hf(random_params(odd, seed=5), odd, tmp_path / "m", layout="minicpm", log=logged.append,
                   no_tokenizer=True)
    hit = [w for w in res.warnings if "head_dim 8 is not hidden_size/num_attention_heads (64/4)" in w]
    assert len(hit) == 1 and "convert_hf_to_gguf.py" in hit[0] and "minicpm4 export gguf" in hit[0]
    assert logged == [f"warning: {w}" for w in res.warnings]
    assert hit[0] in read_json(tmp_path / "m" / MANIFEST_NAME)["warnings"]
    assert read_json(tmp_path / "m" / "config.json")["head_dim"] == 8
    assert import_hf(tmp_path / "m", tmp_path / "r", no_tokenizer=True).cfg == odd
    res = write_hf(random_params(odd, seed=5), odd, tmp_path / "l", layout="llama", no_tokenizer=True)
    assert not any("head_dim" in w for w in res.warnings)
    same = dataclasses.replace(base, head_dim=16)  # explicit, equal to hidden/heads
    res = write_hf(random_params(same, seed=5), same, tmp_path / "s", layout="minicpm", no_tokenizer=True)
    assert not any("head_dim" in w for w in res.warnings)


def test_reimport_of_a_saved_export_with_the_implied_head_dim_equals_the_source(tmp_path):
    """Helper 101: transformers' save_pretrained of an export writes ``head_dim`` (= hidden/heads) into config.json;
    its import had ``head_dim=16`` where the source had ``None`` (same width, but not the same config, and a
    re-export then wrote a head_dim key the official configs lack)."""
    cfg = tiny_cfg(tied=False)
    params = random_params(cfg, seed=6)
    write_hf(params, cfg, tmp_path / "m", layout="minicpm", no_tokenizer=True)
    hf = read_json(tmp_path / "m" / "config.json")
    assert "head_dim" not in hf
    (tmp_path / "m" / "config.json").write_text(json.dumps({**hf, "head_dim": 16}))
    imp = import_hf(tmp_path / "m", tmp_path / "r", no_tokenizer=True)
    assert imp.cfg == cfg and imp.cfg.head_dim is None
    _assert_bit_identical(flat_params(imp.params), params)
    write_hf(imp.params, imp.cfg, tmp_path / "again", layout="minicpm", no_tokenizer=True)
    assert read_json(tmp_path / "again" / "config.json") == hf
    assert ModelConfig.from_hf_config({**hf, "head_dim": 8}).head_dim == 8  # another width is kept


def test_import_names_the_sparse_generation(tmp_path, capsys):
    """An official sparse_config has no variant key (spec §0, §8.1): gen2 with a warning, --sparse-variant picks."""
    cfg = tiny_cfg(sparse=True)
    write_hf(random_params(cfg, seed=12), cfg, tmp_path / "m", layout="minicpm", no_tokenizer=True)
    hf = read_json(tmp_path / "m" / "config.json")
    assert hf["sparse_config"]["variant"] == "gen2"  # our exports name it: no warning, kept
    assert not any("names no variant" in w for w in import_hf(tmp_path / "m", tmp_path / "a", no_tokenizer=True).warnings)
    del hf["sparse_config"]["variant"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    res = import_hf(tmp_path / "m", tmp_path / "b", no_tokenizer=True)
    assert res.cfg.sparse_config.variant == "gen2"
    assert any("names no variant" in w and "--sparse-variant gen1" in w for w in res.warnings), res.warnings
    capsys.readouterr()
    assert main(["import", "hf", str(tmp_path / "m"), "--out", str(tmp_path / "c"), "--no-tokenizer",
                 "--sparse-variant", "gen1"]) == 0
    assert "names no variant" not in capsys.readouterr().err
    assert read_json(tmp_path / "c" / "config.json")["model"]["sparse_config"]["variant"] == "gen1"
    # a dense folder has nothing to apply it to
    dense = tiny_cfg()
    write_hf(random_params(dense, seed=3), dense, tmp_path / "d", no_tokenizer=True)
    with pytest.raises(ConvertError, match="has no sparse_config"):
        import_hf(tmp_path / "d", tmp_path / "e", no_tokenizer=True, sparse_variant="gen1")
    with pytest.raises(ConvertError, match="--sparse-variant 'gen3'"):
        import_hf(tmp_path / "m", tmp_path / "f", no_tokenizer=True, sparse_variant="gen3")
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()


def test_sparse_variant_is_applied_before_the_config_checks(tmp_path):
    """gen2 needs topk >= init_blocks + 1 (gen1 does not): --sparse-variant was applied after read_hf_config's checks,
    so an official folder with topk 1 was refused under --sparse-variant gen1 (it fits gen1), and a gen1 folder
    imported unchecked as gen2 under --sparse-variant gen2 (select_params then failed at the first forward)."""
    cfg = tiny_cfg(sparse=True)
    write_hf(random_params(cfg, seed=12), cfg, tmp_path / "m", layout="minicpm", no_tokenizer=True)
    hf = read_json(tmp_path / "m" / "config.json")
    hf["sparse_config"].update(topk=1, init_blocks=1)
    del hf["sparse_config"]["variant"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConvertError, match="topk=1 with init_blocks=1: .*use topk >= 2"):
        import_hf(tmp_path / "m", tmp_path / "a", no_tokenizer=True)  # read as gen2
    res = import_hf(tmp_path / "m", tmp_path / "b", no_tokenizer=True, sparse_variant="gen1")
    assert (res.cfg.sparse_config.variant, res.cfg.sparse_config.topk) == ("gen1", 1)
    hf["sparse_config"]["variant"] = "gen1"
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConvertError, match="topk=1 with init_blocks=1: .*use topk >= 2"):
        import_hf(tmp_path / "m", tmp_path / "c", no_tokenizer=True, sparse_variant="gen2")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------------
# field_faults B10 for the official ("runtime applies the μP scalars") layout
# ------------------------------------------------------------------------------------------------


def _official_runtime_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """float64 logits ``[t, vocab]`` of one sequence computed from the exported files alone, as MiniCPM's own
    modeling code does: the raw tensors of ``model.safetensors`` (no import path of this project) through the
    independent NumPy forward of ``tests/test_model.py`` (:func:`np_forward`), which applies the μP scalars and the
    LongRoPE settings of ``config.json`` at run time."""
    from safetensors.numpy import load_file
    from test_model import np_forward

    cfg = ModelConfig.from_hf_config(read_json(folder / "config.json"))
    w = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    h, d, nq, nkv = cfg.hidden_size, cfg.resolved_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def stack(name, f):  # HF [out, in] per layer -> np_forward's stacked layout
        return np.stack([f(w[f"model.layers.{i}.{name}"]) for i in range(cfg.num_hidden_layers)])

    layers = {
        "input_layernorm": stack("input_layernorm.weight", lambda x: x),
        "post_attention_layernorm": stack("post_attention_layernorm.weight", lambda x: x),
        "q_proj": stack("self_attn.q_proj.weight", lambda x: x.T.reshape(h, nq, d)),
        "k_proj": stack("self_attn.k_proj.weight", lambda x: x.T.reshape(h, nkv, d)),
        "v_proj": stack("self_attn.v_proj.weight", lambda x: x.T.reshape(h, nkv, d)),
        "o_proj": stack("self_attn.o_proj.weight", lambda x: x.T.reshape(nq, d, h)),
        "gate_proj": stack("mlp.gate_proj.weight", lambda x: x.T),
        "up_proj": stack("mlp.up_proj.weight", lambda x: x.T),
        "down_proj": stack("mlp.down_proj.weight", lambda x: x.T),
    }
    p = {"embed_tokens": {"embedding": w["model.embed_tokens.weight"]}, "layers": layers, "norm": w["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        p["lm_head"] = w["lm_head.weight"].T
    return np_forward(p, cfg, ids)


@pytest.mark.parametrize("tied", [True, False])
def test_b10_official_layout_logits_from_the_files_equal_ours(tmp_path, tied):
    """field_faults B10 for ``write_hf(layout="minicpm")``: the μP scalars live in config.json and the tensors are
    not folded, so a runtime that applies them (MiniCPM's modeling code, re-done here in NumPy from the files alone)
    gets our logits. The round-trip test above reads the export back through our own importer, so an exporter and
    importer that both fold (or both drop) a scalar would pass it; this one would not. Distinct scalars (scale_emb 7,
    scale_depth 1.9, width_mult 4) and max_position_embeddings above the original length (attention scaling != 1)."""
    from test_convert_common import jax_logits

    cfg = tiny_cfg(tied=tied, max_pos=128, layers=2)
    params = random_params(cfg, seed=11)
    write_hf(params, cfg, tmp_path / "hf", layout="minicpm", dtype="float32", no_tokenizer=True)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 80))  # past original_max_position_embeddings
    ours = jax_logits(cfg, params, ids)[0]
    theirs = _official_runtime_logits(tmp_path / "hf", ids[0])
    assert float(np.max(np.abs(ours))) > 0.5
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# tokenizer files of an export: what transformers needs to give this project's ids (tokenizers library here;
# transformers itself in test_tokenizer_hf.py)
# ------------------------------------------------------------------------------------------------

_TOK_TEXTS = ["def foo(x):\n    return x", " a leading space", "\nnewline first", "你好，世界", "Hello world",
              "<|im_start|>user\nhi<|im_end|>"]


def test_export_of_a_tokenizer_model_without_tokenizer_json_writes_one(tmp_path, tiny_tokenizer_dir):
    """A SentencePiece folder without tokenizer.json (as an imported official MiniCPM4 one) gets a generated
    tokenizer.json (BOS post-processor, no dummy prefix) and a tokenizer_config.json that says add_prefix_space
    false; the source files stay as they are."""
    from tokenizers import Tokenizer as HFTokenizer

    from minicpm4_jax.tokenizer import load_tokenizer

    src = tmp_path / "tok"
    src.mkdir()
    for n in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / n, src / n)
    cfg_src = read_json(src / "tokenizer_config.json")
    cfg_src["add_prefix_space"] = None  # as the official file: transformers 5 reads null as true
    (src / "tokenizer_config.json").write_text(json.dumps(cfg_src))
    before = {n: (src / n).read_bytes() for n in ("tokenizer.model", "tokenizer_config.json")}
    cfg = tiny_cfg()
    res = write_hf(random_params(cfg, seed=40), cfg, tmp_path / "hf", tokenizer_dir=src)
    out = tmp_path / "hf"
    assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} <= set(res.manifest["tokenizer_files"])
    assert any("generated from tokenizer.model" in n for n in res.manifest["tokenizer_notes"])
    tc = read_json(out / "tokenizer_config.json")
    assert tc["add_prefix_space"] is False and tc["add_bos_token"] is True and tc["bos_token"] == "<s>"
    tok = load_tokenizer(src)
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    for text in _TOK_TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), text
        assert hf.encode(text).ids == [tok.bos_id] + tok.encode(text), text
    assert {n: (src / n).read_bytes() for n in before} == before
    assert (out / "tokenizer.model").read_bytes() == before["tokenizer.model"]


def test_export_adds_the_bos_post_processor_to_an_old_tokenizer_json(tmp_path, tiny_tokenizer_dir):
    """A run saved before tokenizer.json carried a post-processor (post_processor null): transformers ignores
    add_bos_token when tokenizer.json exists, so the export fills the post-processor in (only that key)."""
    from tokenizers import Tokenizer as HFTokenizer

    from minicpm4_jax.tokenizer import load_tokenizer

    src = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, src)
    old = json.loads((src / "tokenizer.json").read_text())
    old["post_processor"] = None
    (src / "tokenizer.json").write_text(json.dumps(old))
    cfg = tiny_cfg()
    res = write_hf(random_params(cfg, seed=41), cfg, tmp_path / "hf", tokenizer_dir=src)
    tok = load_tokenizer(src)
    hf = HFTokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    for text in _TOK_TEXTS:
        assert hf.encode(text).ids == [1] + tok.encode(text), text
    new = read_json(tmp_path / "hf" / "tokenizer.json")
    assert new["post_processor"]["type"] == "TemplateProcessing"
    assert {k: v for k, v in new.items() if k != "post_processor"} == {k: v for k, v in old.items()
                                                                      if k != "post_processor"}
    assert any("post_processor added" in n for n in res.manifest["tokenizer_notes"])
    # a tokenizer.json with a post-processor is copied byte for byte
    res2 = write_hf(random_params(cfg, seed=41), cfg, tmp_path / "hf2", tokenizer_dir=tiny_tokenizer_dir)
    assert res2.manifest["tokenizer_notes"] == []
    assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == (tiny_tokenizer_dir / "tokenizer.json").read_bytes()


def test_document_start_follows_the_model_through_export_and_import(imported_run, tmp_path, capsys, monkeypatch):
    """What a model's documents start after (helper 69: `generate` / `eval` prompted an imported official model
    after EOS, which it never saw): BOS for an import of a folder whose tokenizer adds BOS, EOS for a run trained
    here (documents joined with EOS), carried by the export's manifest through a re-import; `generate --prefix`
    and `EvalModel.from_checkpoint` use it unless told otherwise."""
    from minicpm4_jax.eval.model import EvalModel
    from minicpm4_jax.tokenizer import document_start

    run, _, _ = imported_run
    assert read_json(run / MANIFEST_NAME)["document_start"] == "bos"
    assert document_start(run) == "bos" and document_start(run / "checkpoints", run / "checkpoints") == "bos"
    # a run trained here: data.json, no import manifest (a copy of the imported run's weights)
    trained = tmp_path / "trained"
    shutil.copytree(run, trained)
    (trained / MANIFEST_NAME).unlink()
    (trained / "data.json").write_text("{}")
    assert document_start(trained) == "eos"
    assert document_start(tmp_path / "nothing") == "eos"
    # helper 71: a damaged import manifest still marks an import (it fell back to EOS), a tokenizer without the
    # recorded token gives nothing before a document
    from types import SimpleNamespace

    from minicpm4_jax.convert.hf_import import _document_start

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / MANIFEST_NAME).write_text("{bad")
    assert document_start(broken) == "bos"
    assert _document_start(tmp_path / "nothing", SimpleNamespace(bos_id=None, eos_id=2)) == "none"
    assert _document_start(tmp_path / "nothing", SimpleNamespace(bos_id=1, eos_id=2)) == "bos"
    for src, want in ((run, "bos"), (trained, "eos")):
        out = tmp_path / f"export_{src.name}"
        assert main(["export", "hf", "--checkpoint", str(src), "--out", str(out)]) == 0, capsys.readouterr().err
        assert read_json(out / MANIFEST_NAME)["source"]["document_start"] == want
        again = tmp_path / f"reimport_{src.name}"
        assert main(["import", "hf", str(out), "--out", str(again)]) == 0, capsys.readouterr().err
        assert read_json(again / MANIFEST_NAME)["document_start"] == want
        em = EvalModel.from_checkpoint(again, batch_size=1, progress=False)
        assert em.prefix == want and em.prefix_ids == [getattr(em.tokenizer, f"{want}_id")]
        assert EvalModel.from_checkpoint(again, batch_size=1, progress=False, prefix="none").prefix_ids == []
    # an official folder whose tokenizer adds no BOS: nothing before a document
    cfg_path = tmp_path / "export_run" / "tokenizer_config.json"
    tc = read_json(cfg_path)
    tc["add_bos_token"] = False
    cfg_path.write_text(json.dumps(tc))
    (tmp_path / "export_run" / MANIFEST_NAME).unlink()
    assert main(["import", "hf", str(tmp_path / "export_run"), "--out", str(tmp_path / "nobos")]) == 0
    assert read_json(tmp_path / "nobos" / MANIFEST_NAME)["document_start"] == "none"

    seen = _record_prefixes(monkeypatch)
    tok = EvalModel.from_checkpoint(run, batch_size=1, progress=False).tokenizer
    for args, want in (([], [tok.bos_id]), (["--prefix", "eos"], [tok.eos_id]), (["--prefix", "none"], [])):
        rc = main(["generate", "--checkpoint", str(run), "--prompt", "a", "--max-new-tokens", "1", "--no-stream", *args])
        assert rc == 0, capsys.readouterr().err
        assert seen[-1] == want, args
    assert main(["generate", "--checkpoint", str(trained), "--prompt", "a", "--max-new-tokens", "1", "--no-stream"]) == 0
    assert seen[-1] == [tok.eos_id]
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(run), "--prompt", "a", "--prefix", "cls"])


# ------------------------------------------------------------------------------------------------
# the token a runtime prepends: the EOS for a run trained here (its documents start after EOS)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["minicpm", "llama"])
def test_export_of_a_run_trained_here_makes_runtimes_prepend_the_eos(trained_run, tmp_path, layout, capsys):
    """The data pipeline joins documents with EOS, so a run trained here saw every document after an EOS; its HF
    export is written the GPT-2 way (bos_token = the EOS, add_bos_token true, a tokenizer.json post-processor that
    puts it first, bos_token_id = the EOS id in config.json and generation_config.json), so a consumer's default
    tokenization is ours after [eos]. Before this, the export prepended <s> (helper 69: first-token loss 7.63 nats
    after BOS against 4.19 after EOS) and the README told users to prepend the EOS by hand."""
    from tokenizers import Tokenizer as HFTokenizer

    from minicpm4_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(trained_run / "tokenizer")
    eos = tok.eos_id
    assert (tok.bos_id, eos) == (1, 2)
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(trained_run), "--out", str(out), "--layout", layout]) == 0, \
        capsys.readouterr().err
    tc = read_json(out / "tokenizer_config.json")
    assert tc["bos_token"] == "</s>" == tc["eos_token"] and tc["add_bos_token"] is True
    assert read_json(out / "special_tokens_map.json")["bos_token"] == "</s>"
    for name in ("config.json", "generation_config.json"):
        got = read_json(out / name)
        assert got["bos_token_id"] == eos and got["eos_token_id"] == eos, name
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    for text in _TOK_TEXTS:
        assert hf.encode(text).ids == [eos] + tok.encode(text), text
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), text
    man = read_json(out / MANIFEST_NAME)
    assert man["source"]["document_start"] == "eos"
    assert any("bos_token '</s>' (the EOS, id 2)" in n for n in man["tokenizer_notes"]), man["tokenizer_notes"]
    assert man["warnings"] == []  # the model's own bos_token_id (1) still matches the tokenizer's <s>
    # the run itself is untouched: its tokenizer still names <s> as BOS, its model config bos_token_id 1
    assert read_json(trained_run / "tokenizer" / "tokenizer_config.json")["bos_token"] == "<s>"
    assert read_json(trained_run / "config.json")["model"]["bos_token_id"] == 1


def test_reimport_of_a_trained_run_export_keeps_the_eos_start_without_the_manifest(trained_run, tmp_path, capsys,
                                                                                    monkeypatch):
    """`import hf` of that export gives document_start eos, from the manifest or, when only the Hugging Face files
    were copied, from tokenizer_config.json's bos_token being the EOS; the imported model.bos_token_id is the
    tokenizer's <s> again (the export's bos_token_id 2 is the runtimes' view), so the run's special ids agree
    with its tokenizer, generate prompts after [eos], and a second export writes the same files."""
    from minicpm4_jax.tokenizer import document_start, load_run_tokenizer, special_id_mismatches

    exported = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(trained_run), "--out", str(exported)]) == 0
    copied = tmp_path / "copied"
    shutil.copytree(exported, copied)
    (copied / MANIFEST_NAME).unlink()
    seen = _record_prefixes(monkeypatch)
    for src in (exported, copied):
        run = tmp_path / f"run_{src.name}"
        assert main(["import", "hf", str(src), "--out", str(run)]) == 0, capsys.readouterr().err
        assert read_json(run / MANIFEST_NAME)["document_start"] == "eos", src.name
        assert document_start(run) == "eos"
        model_cfg = load_config(run / "config.json").model
        tok = load_run_tokenizer(run, run / "checkpoints")
        assert model_cfg.bos_token_id == tok.bos_id == 1 and tuple(model_cfg.eos_token_id) == (tok.eos_id,) == (2,)
        assert special_id_mismatches(tok, model_cfg) == []
        assert main(["generate", "--checkpoint", str(run), "--prompt", "def", "--max-new-tokens", "1",
                     "--no-stream"]) == 0
        assert seen[-1] == [2]
        again = tmp_path / f"again_{src.name}"
        assert main(["export", "hf", "--checkpoint", str(run), "--out", str(again)]) == 0
        assert read_json(again / MANIFEST_NAME)["warnings"] == []
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json"):
            assert (again / f).read_bytes() == (exported / f).read_bytes(), (src.name, f)


def test_document_start_of_a_folder_without_manifest(tmp_path):
    """`_document_start` without a manifest: what the folder's tokenizer prepends, as a runtime reads it."""
    from types import SimpleNamespace

    from minicpm4_jax.convert.hf_import import _document_start

    sp = SimpleNamespace(bos_id=1, eos_id=2, token_to_id={"<s>": 1, "</s>": 2, "<|im_end|>": 73440}.get)
    cases = [
        # (tokenizer_config.json, config.json, tokenizer, want)
        ({"bos_token": "</s>", "eos_token": "</s>", "add_bos_token": True}, None, sp, "eos"),
        # a run fine-tuned here from the official model: its chat eos_token is <|im_end|>, documents end with </s>
        ({"bos_token": "</s>", "eos_token": "<|im_end|>"}, None, sp, "eos"),
        ({"bos_token": "</s>", "eos_token": "</s>"}, None, None, "eos"),
        ({"bos_token": {"content": "</s>"}, "eos_token": {"content": "</s>"}}, None, None, "eos"),
        # --no-tokenizer on such a run's export without its manifest: the strings differ, config.json's ids decide
        # (helper 74: "bos" was final, and a re-export prepended <s>)
        ({"bos_token": "</s>", "eos_token": "<|im_end|>"}, {"bos_token_id": 2, "eos_token_id": [2, 73440]}, None,
         "eos"),
        ({"bos_token": "<s>", "eos_token": "<|im_end|>"}, {"bos_token_id": 1, "eos_token_id": [2, 73440]}, None,
         "bos"),
        ({"bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": True}, None, sp, "bos"),
        ({"bos_token": "</s>", "eos_token": "</s>", "add_bos_token": False}, None, sp, "none"),
        (None, {"bos_token_id": 2, "eos_token_id": [2, 73440]}, sp, "eos"),
        (None, {"bos_token_id": 1, "eos_token_id": [2, 73440]}, sp, "bos"),
        (None, None, sp, "bos"),
        # a tokenizer without the token: nothing before a document (as generate and eval fall back)
        ({"bos_token": "</s>", "eos_token": "</s>"}, None, SimpleNamespace(bos_id=None, eos_id=None,
                                                                           token_to_id=lambda t: None), "none"),
    ]
    for i, (tc, cj, tok, want) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        if tc is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(tc))
        if cj is not None:
            (d / "config.json").write_text(json.dumps(cj))
        assert _document_start(d, tok) == want, (tc, cj, want)


def test_export_tokenizer_files_for_each_document_start(tmp_path, tiny_tokenizer_dir):
    """`write_tokenizer_files`: eos -> the EOS first (also a tokenizer.json-only tokenizer, whose ByteLevel-style
    post-processor is kept in a Sequence), none -> nothing first, bos -> the files as before; a bad start is one
    line."""
    from tokenizers import Tokenizer as HFTokenizer

    from minicpm4_jax.convert.hf_export import write_tokenizer_files
    from minicpm4_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    text = "def foo(x):\n    return x"
    for start, first in (("eos", [2]), ("none", []), ("bos", [1])):
        dest = tmp_path / start
        dest.mkdir()
        _files, notes = write_tokenizer_files(tiny_tokenizer_dir, dest, start)
        hf = HFTokenizer.from_file(str(dest / "tokenizer.json"))
        assert hf.encode(text).ids == first + tok.encode(text), start
        tc = read_json(dest / "tokenizer_config.json")
        assert tc["add_bos_token"] is (start != "none") and tc["bos_token"] == ("</s>" if start == "eos" else "<s>")
        assert (notes == []) is (start == "bos")
    # a tokenizer.json-only tokenizer (kind "hf") with a Sequence post-processor holding a ByteLevel
    hf_only = tmp_path / "hf_only"
    hf_only.mkdir()
    data = read_json(tiny_tokenizer_dir / "tokenizer.json")
    data["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        data["post_processor"]]}
    (hf_only / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(tiny_tokenizer_dir / "tokenizer_config.json", hf_only / "tokenizer_config.json")
    dest = tmp_path / "hf_eos"
    dest.mkdir()
    write_tokenizer_files(hf_only, dest, "eos")
    pp = read_json(dest / "tokenizer.json")["post_processor"]
    assert [p["type"] for p in pp["processors"]] == ["ByteLevel", "TemplateProcessing"]
    assert HFTokenizer.from_file(str(dest / "tokenizer.json")).encode(text).ids == [2] + tok.encode(text)
    assert load_tokenizer(dest).bos_id == 2  # this kind reads its BOS from tokenizer_config.json
    with pytest.raises(ConvertError, match=r"^document_start 'cls' is not one of \['eos', 'bos', 'none'\]$"):
        write_tokenizer_files(tiny_tokenizer_dir, tmp_path / "eos", "cls")


def test_generate_sparse_on_a_model_shorter_than_dense_len_warns(trained_run, capsys):
    """Helper 73: `generate --sparse` on a model of 128 positions (dense_len 8192 from the MiniCPM4.1 defaults) ran
    dense throughout and said only "attention infllmv2"; `eval` warned already."""
    from minicpm4_jax.cli import main

    assert main(["generate", "--checkpoint", str(trained_run), "--prompt", "a", "--max-new-tokens", "2", "--no-stream",
                 "--sparse"]) == 0
    err = capsys.readouterr().err
    assert ("warning: sparse attention with dense_len=8192 >= max_position_embeddings=128: a sequence shorter than "
            "dense_len runs dense attention, so every request to this model runs dense") in err, err
    assert "(dense throughout: " in err


def _record_prefixes(monkeypatch) -> list:
    """Make ``minicpm4 generate`` record the ``prefix_ids`` of every call (the list returned) and go on."""
    from minicpm4_jax import generate as generate_module

    seen = []
    real_generate = generate_module.generate

    def recording_generate(*a, **kw):
        seen.append(list(kw["prefix_ids"]))
        return real_generate(*a, **kw)

    monkeypatch.setattr(generate_module, "generate", recording_generate)
    return seen


def test_no_tokenizer_import_of_a_trained_run_export_reexports_without_warnings(trained_run, tmp_path, capsys):
    """`import hf --no-tokenizer` of a run-trained-here export cannot know the tokenizer's own <s>: it keeps
    config.json's bos_token_id (the EOS, 2) with document_start eos. Re-exported with the run's tokenizer, that id is
    what the export writes as BOS anyway; it warned "tokenizer bos id 1 != model.bos_token_id 2" about a value the
    import itself produced. The files equal the first export's; another document start still warns."""
    from minicpm4_jax.tokenizer import load_tokenizer, special_id_mismatches

    exported = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(trained_run), "--out", str(exported)]) == 0
    run = tmp_path / "run"
    assert main(["import", "hf", str(exported), "--out", str(run), "--no-tokenizer"]) == 0
    model_cfg = load_config(run / "config.json").model
    assert model_cfg.bos_token_id == 2 and read_json(run / MANIFEST_NAME)["document_start"] == "eos"
    capsys.readouterr()
    for name, extra in (("with_tok", ["--tokenizer", str(trained_run / "tokenizer")]), ("no_tok", ["--no-tokenizer"])):
        again = tmp_path / name
        assert main(["export", "hf", "--checkpoint", str(run), "--out", str(again), *extra]) == 0
        assert "warning" not in capsys.readouterr().err
        assert read_json(again / MANIFEST_NAME)["warnings"] == [], name
        for f in ("config.json", "generation_config.json") + (("tokenizer.json", "tokenizer_config.json")
                                                             if name == "with_tok" else ()):
            assert (again / f).read_bytes() == (exported / f).read_bytes(), (name, f)
    tok = load_tokenizer(trained_run / "tokenizer")
    assert special_id_mismatches(tok, model_cfg, "bos") == ["tokenizer bos id 1 != model.bos_token_id 2"]
    assert special_id_mismatches(tok, model_cfg, "eos") == []
