"""The ``--help`` texts of ``minicpm4`` and every subcommand: every option explained, every default shown as the code
has it, every config key the ``train`` help lists a real key (no training, no jax work here)."""

import argparse
import dataclasses

import pytest

from minicpm4_jax.cli import build_parser
from minicpm4_jax.config import TrainConfig


def _parsers(parser, path=("minicpm4",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _options():
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                yield " ".join(path), parser, action


def test_every_option_has_help_stating_its_default():
    """An option without a help line (``eval bench --batch-size``, ``--prefill-chunk``) or whose help leaves out a
    default the code applies (``eval bench --seed`` 1234, ``--exec-timeout`` 10, ``eval ruler --batch-size`` 8) left a
    newcomer guessing."""
    missing, no_default = [], []
    for where, parser, action in _options():
        name = action.option_strings[0] if action.option_strings else action.dest
        text = action.help or ""
        if not text.strip():
            missing.append(f"{where} {name}")
            continue
        if action.default in (None, False, [], argparse.SUPPRESS):
            continue  # nothing given: the help says what the code does then
        shown = parser._get_formatter()._expand_help(action)
        if str(action.default) not in shown:
            no_default.append(f"{where} {name} (default {action.default!r})")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help does not show the default: {no_default}"


def test_train_help_names_every_config_section_and_top_level_key():
    """``minicpm4 train --help`` listed the sections and top-level keys, but not ``distributed`` nor the keys added
    since (``mtp_loss_weight``, ``gradient_accumulation_steps``, ``branch_from``, ``profile_start_step``, ...)."""
    train = dict((p[-1], parser) for p, parser in _parsers(build_parser()))["train"]
    text = train.format_help()
    absent = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in text]
    assert not absent, f"config keys missing from `minicpm4 train --help`: {absent}"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["generate", "--help"], ["import", "hf", "--help"],
                                  ["export", "hf", "--help"], ["export", "gguf", "--help"], ["export", "eagle", "--help"],
                                  ["eval", "ruler", "--help"], ["eval", "bench", "--help"], ["eval", "report", "--help"]])
def test_help_prints_and_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 0
    assert "usage: minicpm4" in capsys.readouterr().out


def test_resume_help_names_every_key_a_resume_may_change():
    """``train --resume``'s help said a resume may change only "logging, eval, sampling, checkpoint frequency/location,
    max_train_minutes and out_dir"; the code also lets it change the mesh, the process layout, gradient accumulation,
    logits_chunk_size, remat, the attention implementation, profiling, data.cache_dir and the branch keys
    (``RESUME_MAY_CHANGE``)."""
    from minicpm4_jax.train.checkpoint import RESUME_MAY_CHANGE

    train = dict((p[-1], parser) for p, parser in _parsers(build_parser()))["train"]
    text = " ".join(next(a.help for a in train._actions if "--resume" in a.option_strings).split())
    absent = [k for k in sorted(RESUME_MAY_CHANGE)
              if k not in text and f"{k.split('.')[0]}.*" not in text and f"{k.split('_')[0]}_*" not in text]
    assert not absent, f"keys a resume may change but --resume's help does not name: {absent}"
