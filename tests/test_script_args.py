"""The scripts in ``scripts/`` refuse zero, negative and out-of-range numbers with one line, before any work.

Each case runs a script's ``main(argv)`` in this process (the scripts are not a package) and expects argparse's usage
error (exit 2) or a one-line ``sys.exit`` message naming the option; before, ``--rounds 0`` or ``--repeats 0`` ended
in ``statistics.median([])``, ``--steps 0`` in a ZeroDivisionError or an unbound local, and ``--lengths -5`` or
``--steps 0`` (qat_token_share: the preset's steps) ran silently.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from minicpm4_jax.argtypes import float_range, int_range

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_MODULES: dict[str, object] = {}


def _script(name: str):
    if name not in _MODULES:
        path = SCRIPTS / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[name] = mod
    return _MODULES[name]


def test_range_types():
    assert int_range(1)("3") == 3 and int_range(0, 2)("0") == 0
    assert float_range(0, 1, lo_open=True)("1") == 1.0
    for parse, text, msg in [(int_range(1), "0", "0 is out of range: give an integer >= 1"),
                             (int_range(0, 2), "3", "give an integer >= 0 and <= 2"),
                             (int_range(1), "1.5", "'1.5' is not an integer"),
                             (float_range(0, lo_open=True), "0", "give a finite number > 0"),
                             (float_range(0, 1, hi_open=True), "1", "< 1"),
                             (float_range(0), "nan", "out of range"),
                             (float_range(0), "x", "'x' is not a number")]:
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            parse(text)


CASES = [
    ("bench_decode", ["--rounds", "0"], "argument --rounds: 0 is out of range: give an integer >= 1"),
    ("bench_decode", ["--steps", "0"], "argument --steps: 0 is out of range"),
    ("bench_decode", ["--warmup", "-1"], "argument --warmup: -1 is out of range: give an integer >= 0"),
    ("bench_decode", ["--lengths", "-5"], "argument --lengths: -5 is out of range"),
    ("bench_decode", ["--num-draft", "0"], "argument --num-draft: 0"),
    ("bench_decode", ["--fr-spec-vocab", "512"], "--fr-spec-vocab 512 restricts a trained draft head: give --checkpoint"),
    ("bench_attention", ["--repeats", "0"], "argument --repeats: 0 is out of range"),
    ("bench_attention", ["--bwd-max", "-1"], "argument --bwd-max: -1 is out of range"),
    ("bench_attention", ["--lengths", "600"], "--lengths 600: the dense baseline tiles T by 128 and 512"),
    ("bench_attention", ["--attn-q-tile", "0"], "argument --attn-q-tile: 0"),
    ("bench_dense_attention", ["--repeats", "0"], "argument --repeats: 0 is out of range"),
    ("bench_dense_attention", ["--block-q", "0"], "argument --block-q: 0 is out of range"),
    ("bench_compile_cache", ["--rounds", "0"], "argument --rounds: 0 is out of range"),
    ("bench_compile_cache", ["--skip-train"], "--skip-train needs --checkpoint"),
    ("bench_compile_cache", ["--checkpoint", "/no/such/run"], "--checkpoint /no/such/run is not a folder"),
    ("bench_train", ["--steps", "0"], "argument --steps: 0 is out of range"),
    ("bench_train", ["--warmup", "-1"], "argument --warmup: -1"),
    ("bench_train", ["--no-jax", "--mesh", "1,1,2"], "--mesh runs the JAX step on a mesh, which --no-jax skips"),
    ("bench_train", ["--no-jax"], "nothing is measured"),
    ("build_fr_spec", ["--checkpoint", "run", "--size", "0"], "argument --size: 0 is out of range"),
    ("gpu_kernel_check", ["--iters", "0"], "argument --iters: 0 is out of range"),
    ("gpu_kernel_check", ["--deadline-s", "0"], "argument --deadline-s: 0 is out of range: give a finite number > 0"),
    ("mup_transfer", ["--widths", "-64", "64"], "argument --widths: -64 is out of range: give an integer >= 64"),
    ("mup_transfer", ["--lrs", "0"], "argument --lrs: 0 is out of range"),
    ("mup_transfer", ["--steps", "0"], "argument --steps: 0"),
    ("plot_infllm_selection", ["--random", "0"], "argument --random: 0 is out of range"),
    ("plot_infllm_selection", ["--checkpoint", "run", "--layer", "-1"], "argument --layer: -1 is out of range"),
    ("plot_infllm_selection", ["--random", "64", "--heads", "3"], "--heads 3 must be a multiple of --kv-heads 2"),
    ("plot_infllm_selection", ["--random", "64", "--topk", "0"], "argument --topk: 0"),
    # a missing or folder input file was a FileNotFoundError / IsADirectoryError traceback (after loading the run)
    ("plot_infllm_selection", ["--checkpoint", "run", "--text", "/no/such.txt"], "--text /no/such.txt is not a file"),
    ("plot_infllm_selection", ["--checkpoint", "run", "--text", "/"], "--text / is not a file"),
    ("plot_infllm_selection", ["--npz", "/no/such.npz"], "--npz /no/such.npz is not a file"),
    ("qat_token_share", ["--steps", "0"], "argument --steps: 0 is out of range"),
    ("qat_token_share", ["--shares", "0"], "argument --shares: 0 is out of range: give a finite number > 0 and < 1"),
    ("qat_token_share", ["--shares", "1.5"], "argument --shares: 1.5 is out of range"),
    ("qat_token_share", ["--qat-warmup", "2"], "argument --qat-warmup: 2 is out of range"),
    ("qat_token_share", ["--shares", "0.1", "steps=4", "0.2"], "'0.2' follows the override 'steps=4'"),
]


@pytest.mark.parametrize("name,argv,msg", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_bad_numbers_are_one_line(name, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _script(name).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, (e.value.code, err)
    last = err.strip().splitlines()[-1]
    assert msg in last and "Traceback" not in err, err


def test_selection_plot_geometry_is_one_line():
    """A sparse geometry select_params refuses (block 24 is no multiple of stride 16): one line, not a ValueError."""
    with pytest.raises(SystemExit, match=r"^error: .*multiples.*\(--block-size, --kernel-size"):
        _script("plot_infllm_selection").main(["--random", "64", "--block-size", "24", "--out", "/dev/null"])
    # gen2's topk below init_blocks + 1: the flags to change are named (the hint named the geometry flags only)
    with pytest.raises(SystemExit, match=r"^error: sparse_config.topk=1 with init_blocks=1: .*use topk >= 2 .*--topk"):
        _script("plot_infllm_selection").main(["--random", "64", "--topk", "1", "--out", "/dev/null"])


def test_selection_plot_unreadable_npz_is_one_line(tmp_path):
    """An ``--npz`` that is no NumPy archive, or lacks ``q`` / ``k``, was a ValueError / KeyError traceback."""
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    with pytest.raises(SystemExit, match=r"^error: cannot read --npz .*bad.npz"):
        _script("plot_infllm_selection").main(["--npz", str(bad), "--out", "/dev/null"])
    only_q = tmp_path / "q.npz"
    np.savez(only_q, q=np.zeros((4, 2, 8), np.float32))
    with pytest.raises(SystemExit, match=r"^error: cannot read --npz .*q.npz: 'k is not a file in the archive'"):
        _script("plot_infllm_selection").main(["--npz", str(only_q), "--out", "/dev/null"])


def test_qat_overrides_after_shares_reach_the_config():
    """``--shares 0.25 KEY=VALUE``: the override after the shares is an override (nargs="+" took it as a share and
    refused it as "invalid float value"); an unknown key shows it reached load_config, before any training."""
    from minicpm4_jax.config import ConfigError

    with pytest.raises(ConfigError, match="no_such_key"):
        _script("qat_token_share").main(["--shares", "0.25", "0.5", "no_such_key=1"])
    ap = argparse.ArgumentParser()
    ns = argparse.Namespace(shares=["0.25", "steps=8", "seed=1"], overrides=["data.batch_size=2"])
    _script("qat_token_share")._split_shares(ap, ns, ["data.batch_size=2", "--shares", "0.25", "steps=8", "seed=1"])
    assert ns.shares == [0.25] and ns.overrides == ["data.batch_size=2", "steps=8", "seed=1"]


_HELP_SCRIPTS = ["bench_attention", "bench_decode", "bench_dense_attention", "bench_train", "build_fr_spec",
                 "mup_transfer", "plot_infllm_selection", "plot_train_curves", "qat_token_share"]


@pytest.mark.parametrize("name", _HELP_SCRIPTS)
def test_script_help_explains_every_option_and_shows_its_default(name, monkeypatch):
    """The scripts the README and docs/benchmarks.md tell users to run had options without any help line
    (``bench_attention.py --lengths``/``--repeats``, ``bench_dense_attention.py --block-q``, 12 of
    ``plot_infllm_selection.py``'s, ...) and helps that left the default out (``bench_decode.py --steps`` 32,
    ``--rounds`` 5, ...): 51 options in eight of these nine scripts. The parser is taken from ``main`` as it parses."""

    class Parsed(Exception):
        pass

    got = {}

    def capture(self, *args, **kwargs):
        got["parser"] = self
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed):
        _script(name).main([])
    parser = got["parser"]
    bad = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        shown = parser._get_formatter()._expand_help(action) if action.help else ""
        if not shown.strip():
            bad.append(f"{action.option_strings[0]}: no help")
        elif (action.default not in (None, False, [], argparse.SUPPRESS) and str(action.default) not in shown
              and "default" not in shown):
            bad.append(f"{action.option_strings[0]}: default {action.default!r} not shown")
    assert not bad, f"scripts/{name}.py --help: {bad}"
