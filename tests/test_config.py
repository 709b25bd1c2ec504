"""Configuration: presets, overrides, validation errors, HF config bridge."""

import dataclasses

import pytest

from minicpm4_jax.config import (
    ConfigError,
    ModelConfig,
    RopeScalingConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    diff_configs,
    load_config,
)


def test_cpu_tiny_preset_loads_and_allows_8192_positions():
    cfg = load_config("cpu_tiny")
    assert cfg.model.max_position_embeddings >= 8192
    assert 5e6 <= cfg.model.num_params() <= 20e6
    assert cfg.model.num_attention_heads % cfg.model.num_key_value_heads == 0


def test_overrides_are_typed_and_nested():
    cfg = load_config("cpu_tiny", ["model.intermediate_size=512", "optimizer.learning_rate=3e-3", "data.sources=[a.txt, b.txt]"])
    assert cfg.model.intermediate_size == 512
    assert cfg.optimizer.learning_rate == pytest.approx(3e-3)
    assert cfg.data.sources == ("a.txt", "b.txt")


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.hiden_size'.*did you mean 'hidden_size'"):
        load_config("cpu_tiny", ["model.hiden_size=128"])
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        config_from_dict({"optimiser": {}})


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["model.hidden_size"])


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ConfigError, match="num_attention_heads=6 is not divisible by model.num_key_value_heads=4"):
        load_config("cpu_tiny", ["model.num_attention_heads=6", "model.num_key_value_heads=4", "model.head_dim=32"])


def test_hidden_not_divisible_by_heads():
    with pytest.raises(ConfigError, match="hidden_size=250 is not divisible"):
        load_config("cpu_tiny", ["model.hidden_size=250"])


def test_seq_len_above_max_positions():
    with pytest.raises(ConfigError, match="data.seq_len=9000 is above model.max_position_embeddings=8192"):
        load_config("cpu_tiny", ["data.seq_len=9000"])


def test_rope_factor_list_length_checked():
    with pytest.raises(ConfigError, match="head_dim/2=32"):
        load_config("cpu_tiny", ["model.rope_scaling.long_factor=[1.0, 2.0]"])


def test_rope_factor_mismatch_after_a_head_layout_edit_names_the_layout():
    # editing hidden_size changes the derived head_dim; the message says where head_dim came from
    with pytest.raises(ConfigError, match=r"hidden_size / model.num_attention_heads = 512/4 needs head_dim/2=64"):
        load_config("cpu_tiny", ["model.hidden_size=512"])
    with pytest.raises(ConfigError, match=r"model.head_dim=32 needs head_dim/2=16"):
        load_config("cpu_tiny", ["model.head_dim=32"])


def test_bad_types_are_reported():
    with pytest.raises(ConfigError, match="model.num_hidden_layers='many' must be an integer"):
        load_config("cpu_tiny", ["model.num_hidden_layers=many"])


def test_whole_numbers_in_e_notation_are_integers():
    # YAML 1.1 reads 1e3 as a string: integer keys take any whole number written so, exactly (not via a float)
    cfg = load_config("cpu_tiny", ["steps=2e3", "seed=4.294967295e9"])
    assert (cfg.steps, cfg.seed) == (2000, 4294967295)
    with pytest.raises(ConfigError, match=r"^steps='2.55e1' must be an integer$"):
        load_config("cpu_tiny", ["steps=2.55e1"])
    with pytest.raises(ConfigError, match=r"^seed=10{18} must be in \[0, 4294967295\]$"):
        load_config("cpu_tiny", ["seed=1e18"])
    for huge in ("1e19", "1e5000", "1e50000000"):  # break test 64: 1e5000 crashed, 1e50000000 hung
        with pytest.raises(ConfigError, match=rf"^steps='{huge}' is too large for an integer setting \(at most 19 "
                                              r"digits\)$"):
            load_config("cpu_tiny", [f"steps={huge}"])


@pytest.mark.parametrize("text", ["", "# nothing here yet\n", "---\n"])
def test_an_empty_preset_is_refused(tmp_path, text):
    p = tmp_path / "mine.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"^preset .*mine.yaml is empty \(no sections\); fill it in, or give a "
                                          r"preset such as cpu_tiny$"):
        load_config(str(p))
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {p.name}\nsteps: 10\n")
    with pytest.raises(ConfigError, match=r"mine.yaml is empty"):
        load_config(str(child))


def test_a_string_key_without_a_value_says_how_to_write_an_empty_one():
    with pytest.raises(ConfigError, match=r"^sample_prompt has no value \(YAML null\); give a string, or "
                                          r"sample_prompt=\"''\" for an empty one$"):
        load_config("cpu_tiny", ["sample_prompt="])
    assert load_config("cpu_tiny", ["sample_prompt=''"]).sample_prompt == ""


def test_wsd_lengths_checked():
    with pytest.raises(ConfigError, match="exceed steps"):
        load_config("cpu_tiny", ["steps=10", "optimizer.warmup_steps=50"])


@pytest.mark.parametrize("override, what", [
    # found by a fresh-eyes break test: each ran (seed -1 only failed after the whole run, at the final sample;
    # NaN learning rates at step 2; the others silently)
    ("seed=-1", r"seed=-1 must be in \[0, 4294967295\]"),
    ("data.seed=4294967296", r"data.seed=4294967296 must be in"),
    ("optimizer.learning_rate=.nan", "learning_rate=nan must be a finite number > 0"),
    ("optimizer.learning_rate=1e400", "learning_rate=inf must be a finite number > 0"),
    ("optimizer.weight_decay=-1", "weight_decay=-1.0 must be a finite number >= 0"),
    ("optimizer.grad_clip=-1", "grad_clip=-1.0 must be a finite number >= 0"),
    ("model.scale_emb=0", "model.scale_emb=0.0 must be a finite number > 0"),
    ("model.scale_depth=-1", "model.scale_depth=-1.0 must be a finite number > 0"),
    ("model.initializer_range=-1", "model.initializer_range=-1.0 must be a finite number > 0"),
    ("model.eos_token_id=[99999]", r"model.eos_token_id holds 99999, outside the vocabulary \[0, 8192\)"),
    ("model.bos_token_id=-5", "model.bos_token_id holds -5"),
    ("max_train_minutes=0", "max_train_minutes=0.0 must be > 0 minutes"),
    ("optimizer.decay_fraction=-0.5", r"decay_fraction=-0.5 must be in \[0, 1\]"),
    # a second break test: each was accepted (beta1=2 trained and saved; steps=3e9 failed after writing the run
    # folder; head_dim=0 failed after data preparation; a NaN eps only as a non-finite loss at step 1)
    ("optimizer.beta1=2", r"optimizer.beta1=2.0 must be in \[0, 1\)"),
    ("optimizer.beta2=-1", r"optimizer.beta2=-1.0 must be in \[0, 1\)"),
    ("optimizer.eps=-1", "optimizer.eps=-1.0 must be a finite number > 0"),
    ("optimizer.eps=.nan", "optimizer.eps=nan must be a finite number > 0"),
    ("model.rms_norm_eps=.nan", "model.rms_norm_eps=nan must be a finite number > 0"),
    ("model.rope_theta=.nan", "model.rope_theta=nan must be a finite number > 0"),
    ("model.head_dim=0", "model.head_dim=0 must be positive"),
    ("model.head_dim=-4", "model.head_dim=-4 must be positive"),
    ("steps=3000000000", r"steps=3000000000 must be in \[1, 2147483647\]"),
    ("mesh.axis_types=explicit", "mesh.axis_types='explicit' is not supported; use 'auto'"),
    ("model.rope_scaling={rope_type: longrope}", "model.rope_scaling lacks 'short_factor', 'long_factor'"),
    ("model.rope_scaling={}", "model.rope_scaling lacks"),
])
def test_out_of_range_training_values_are_refused_up_front(override, what):
    with pytest.raises(ConfigError, match=what):
        load_config("cpu_tiny", [override])


def test_mtp_train_depth_is_checked_against_seq_len_only_with_mtp():
    # seq_len 1 trains next-token prediction; the draft's depth bound applies only when there is a draft
    cfg = load_config("cpu_tiny", ["data.seq_len=1", "model.mtp=false"])
    assert cfg.data.seq_len == 1
    with pytest.raises(ConfigError, match=r"data.seq_len=1 must be >= 2 with the MTP head \(model.mtp\)"):
        load_config("cpu_tiny", ["data.seq_len=1", "model.mtp=true"])  # (it named mtp_train_depth, never set)
    with pytest.raises(ConfigError, match=r"mtp_train_depth=2 must be in \[1, data.seq_len=2\)"):
        load_config("cpu_tiny", ["data.seq_len=2", "model.mtp=true", "mtp_train_depth=2"])
    with pytest.raises(ConfigError, match=r"optimizer.decay_steps=-1 must be >= 0"):
        load_config("cpu_tiny", ["optimizer.decay_steps=-1"])


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match="cpu_tiny"):
        load_config("no_such_preset")


def test_dict_round_trip():
    cfg = load_config("minicpm4_8b")
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_diff_configs_names_fields():
    a = load_config("cpu_tiny")
    b = dataclasses.replace(a, model=dataclasses.replace(a.model, hidden_size=128, num_hidden_layers=3))
    diffs = diff_configs(a.model, b.model)
    assert any(d.startswith("hidden_size: 256 != 128") for d in diffs)
    assert any(d.startswith("num_hidden_layers") for d in diffs)
    assert len(diffs) == 2


def test_hf_round_trip_synthetic():
    m = ModelConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling=RopeScalingConfig(short_factor=tuple(1.0 + i for i in range(8)),
                                       long_factor=tuple(2.0 + i for i in range(8)),
                                       original_max_position_embeddings=64),
        eos_token_id=(2, 7),
    )
    assert ModelConfig.from_hf_config(m.to_hf_config()) == m


def test_unknown_rope_type_raises():
    hf = load_config("minicpm4_0p5b").model.to_hf_config()
    hf["rope_scaling"]["rope_type"] = "dynamic"
    with pytest.raises(ConfigError, match="rope_type='dynamic' is not supported"):
        ModelConfig.from_hf_config(hf)


def test_hf_defaults_when_keys_missing():
    # spec §1.1: constructor defaults (tie True, rope_theta 10000, kv heads = heads)
    m = ModelConfig.from_hf_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                    "intermediate_size": 128, "vocab_size": 100})
    assert m.tie_word_embeddings is True
    assert m.rope_theta == 10000.0
    assert m.num_key_value_heads == 4
    assert m.rms_norm_eps == 1e-6


def test_hf_rope_theta_from_rope_parameters():
    """Break test (helper 87): a transformers-5 style config.json with the RoPE base only in ``rope_parameters``
    (plain RoPE or LongRoPE, no top-level ``rope_theta``) imported with the default base 10000, silently."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 100}
    plain = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}})
    assert plain.rope_theta == 5e4 and plain.rope_scaling is None
    f = [1.0] * 8
    long_ = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6,
                                                                    "short_factor": f, "long_factor": f,
                                                                    "original_max_position_embeddings": 64}})
    assert long_.rope_theta == 1e6 and long_.rope_scaling.short_factor == tuple(f)
    # a top-level rope_theta (the released configs) wins
    assert ModelConfig.from_hf_config({**base, "rope_theta": 2e4, "rope_parameters": {"rope_theta": 5e4}}).rope_theta == 2e4


def test_float16_parameters_are_refused_for_training():
    """Sixth break test: model.param_dtype=float16 passed and the loss turned NaN at step 2 (AdamW's state in
    float16 underflows); bfloat16 trains."""
    with pytest.raises(ConfigError, match=r"model.param_dtype='float16' cannot be trained.*use float32 or bfloat16"):
        load_config("cpu_tiny", ["model.param_dtype=float16"])
    assert load_config("cpu_tiny", ["model.param_dtype=bfloat16"]).model.param_dtype == "bfloat16"


@pytest.mark.parametrize("text, match", [
    ("1: 2\n", r"config key 1 \(int\) is not a field name; the keys of the config are names such as 'model'"),
    ("model:\n  3: 4\n", r"config key 'model.3' \(int\) is not a field name; the keys of model are names"),
    ("off: 2\n", r"config key False \(bool \(YAML reads on/off/yes/no as booleans\)\) is not a field name"),
])
def test_yaml_keys_that_are_not_strings_are_one_line(tmp_path, text, match):
    """Sixth break test: a YAML key read as a number or boolean crashed in the did-you-mean helper (difflib)."""
    p = tmp_path / "preset.yaml"
    p.write_text("base: cpu_tiny\n" + text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(p))


@pytest.mark.parametrize("key", ["topk", "init_blocks"])
def test_sparse_topk_beyond_every_block_is_refused(key):
    """Thirteenth-session break test: ``topk=1e9`` (meant as "all blocks") passed and the selection's topk columns
    per query ran out of memory; training refuses more blocks than max_position_embeddings holds, naming the count
    (run_training calls the check before anything is written; inference keeps any topk)."""
    from minicpm4_jax.config import check_training_selection

    # gen2 needs topk >= init_blocks + 1 (test below); gen1's window holds the query's own block
    base = ["model.sparse_config.variant=gen1"] if key == "init_blocks" else []
    with pytest.raises(ConfigError, match=rf"model.sparse_config.{key}=257 exceeds the 256 blocks of "
                                          rf"max_position_embeddings=8192 \(block_size=32\); {key}=256 already"):
        check_training_selection(load_config("cpu_tiny_sparse", base + [f"model.sparse_config.{key}=257"]))
    check_training_selection(load_config("cpu_tiny_sparse", base + [f"model.sparse_config.{key}=256"]))


def test_gen2_topk_must_hold_the_forced_blocks():
    """Eighteenth-session break test: gen2 with topk <= init_blocks (topk=1 passed) forces init_blocks + window + 1
    blocks into topk + window, and top-k cut the query's own block (a token at block 3 attended [0, 2])."""
    from minicpm4_jax.infllm.select import select_params

    with pytest.raises(ConfigError, match=r"model.sparse_config.topk=2 with init_blocks=2: gen2 forces init_blocks \+ "
                                          r"window_size//block_size \+ 1 = 5 blocks into its topk \+ "
                                          r"window_size//block_size = 4, .*use topk >= 3"):
        load_config("cpu_tiny_sparse", ["model.sparse_config.topk=2", "model.sparse_config.init_blocks=2"])
    load_config("cpu_tiny_sparse", ["model.sparse_config.topk=3", "model.sparse_config.init_blocks=2"])
    load_config("cpu_tiny_sparse", ["model.sparse_config.topk=1", "model.sparse_config.variant=gen1"])
    sc = load_config("cpu_tiny_sparse").model.sparse_config
    with pytest.raises(ValueError, match="sparse_config.topk=1 with init_blocks=1: .*use topk >= 2"):
        select_params(dataclasses.replace(sc, topk=1))
    assert select_params(dataclasses.replace(sc, topk=1, init_blocks=0)).topk_cfg == 3


def test_b09_unknown_rope_type_is_refused_on_every_path():
    """B09 (rope_type other than LongRoPE run as LongRoPE): the YAML / override path and the rope functions each
    refuse it on their own (helper 70: with both guards removed, `rope_type: yarn` loaded and ran LongRoPE)."""
    from minicpm4_jax.config import RopeScalingConfig, validate_model
    from minicpm4_jax.nn.rope import longrope_factors

    base = load_config("minicpm4_0p5b").model
    half = base.resolved_head_dim // 2
    orig = base.rope_scaling.original_max_position_embeddings
    lists = f"short_factor: {[1.0] * half}, long_factor: {[2.0] * half}, original_max_position_embeddings: {orig}"
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type='yarn' is not supported"):
        load_config("minicpm4_0p5b", [f"model.rope_scaling={{rope_type: yarn, {lists}}}"])
    bad = dataclasses.replace(base, rope_scaling=RopeScalingConfig(
        rope_type="yarn", short_factor=(1.0,) * half, long_factor=(2.0,) * half,
        original_max_position_embeddings=base.rope_scaling.original_max_position_embeddings))
    with pytest.raises(ConfigError, match="rope_type='yarn' is not supported"):
        validate_model(bad)
    with pytest.raises(ConfigError, match="rope_type='yarn' is not supported"):
        longrope_factors(bad)


def test_a_config_folder_is_named_as_a_folder(tmp_path):
    """Helper 69: `--config configs` (a folder) said "not found"."""
    with pytest.raises(ConfigError, match=r"config '.*' is a folder; give a YAML file in it"):
        load_config(str(tmp_path))
