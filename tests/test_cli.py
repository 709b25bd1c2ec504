"""The ``minicpm4`` command line: argument handling and one-line errors (no training here)."""

import pytest

from minicpm4_jax.cli import main
from minicpm4_jax.config import ConfigError, load_config


def test_overrides_may_follow_options(capsys):
    # an override after an option is still an override: here it is a bad key, so the error names it
    rc = main(["train", "steps=12", "--no-progress", "model.hiden_size=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "did you mean 'hidden_size'" in err[0]


def test_unknown_option_is_rejected():
    with pytest.raises(SystemExit):
        main(["train", "--no-such-option"])


def test_invalid_yaml_names_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+"):
        load_config(str(bad))


@pytest.mark.parametrize("text,key,lines", [
    ("model:\n  hidden_size: 64\n  hidden_size: 128\n", "hidden_size", (2, 3)),
    ("model:\n  hidden_size: 64\nsteps: 3\nmodel:\n  vocab_size: 128\n", "model", (1, 4)),
])
def test_duplicate_yaml_key_is_refused(tmp_path, text, key, lines):
    """PyYAML keeps the last of two equal keys silently; a preset that gives one twice is refused, naming both."""
    bad = tmp_path / "dup.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=rf"key '{key}' given twice \(lines {lines[0]} and {lines[1]}\)"):
        load_config(str(bad))


@pytest.mark.parametrize("over,msg", [
    (["profile_start_step=0"], r"profile_start_step=0 must be in \[1, steps=1000\]"),
    (["profile_start_step=1001"], r"profile_start_step=1001 must be in \[1, steps=1000\]"),
    (["profile_start_step=3", "profile_steps=0"], r"profile_steps=0 must be >= 1"),
])
def test_bad_profile_window(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config("cpu_tiny", ["steps=1000"] + over)


@pytest.mark.parametrize("base", ["5", "[cpu_tiny]", "{a: 1}"])
def test_non_string_base_is_one_line(tmp_path, base):
    """Tenth-session break test: `base: 5` ended in a TypeError traceback (Path / int)."""
    bad = tmp_path / "b.yaml"
    bad.write_text(f"base: {base}\n")
    with pytest.raises(ConfigError, match=r"base: .* must be a preset name or a path to a YAML file \(a string\)"):
        load_config(str(bad))


@pytest.mark.parametrize("value", [".nan", ".inf", "-1"])
def test_sample_temperature_not_finite_is_refused_before_training(value):
    """Tenth-session break test: sample_temperature=.nan passed validation, the whole run trained and the end-of-run
    sample then failed (exit 2, no summary.json)."""
    with pytest.raises(ConfigError, match=r"sample_temperature=.* must be a finite number >= 0"):
        load_config("cpu_tiny", [f"sample_temperature={value}"])
    with pytest.raises(ConfigError, match=r"sample_temperature=1e-40 is below 1e-05: .* sample_temperature=0"):
        load_config("cpu_tiny", ["sample_temperature=1.0e-40"])
    with pytest.raises(ConfigError, match=r"sample_tokens=-1 must be >= 0 \(0 = no end-of-run sample\)"):
        load_config("cpu_tiny", ["sample_tokens=-1"])


def test_yaml_merge_keys_and_unusual_keys(tmp_path):
    """Merge keys (``<<:``) may be overridden by design; 1 and true are different keys; a non-scalar key is a
    one-line error (not the duplicate check's TypeError); a CLI override giving a key twice is refused too."""
    ok = tmp_path / "merge.yaml"
    ok.write_text("base: cpu_tiny\noptimizer: {<<: [{learning_rate: 0.01, warmup_steps: 3}, {weight_decay: 0.3}], "
                  "warmup_steps: 5}\n")
    cfg = load_config(str(ok))
    assert (cfg.optimizer.learning_rate, cfg.optimizer.warmup_steps, cfg.optimizer.weight_decay) == (0.01, 5, 0.3)
    import yaml

    from minicpm4_jax.config import _UniqueKeyLoader

    yaml.load("{1: a, true: b}", Loader=_UniqueKeyLoader)  # different YAML keys: no duplicate error
    bad = tmp_path / "unhashable.yaml"
    bad.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+: .*unhashable"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"override .*key 'learning_rate' given twice"):
        load_config("cpu_tiny", ["optimizer={learning_rate: 0.5, learning_rate: 0.7}"])


def test_non_utf8_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "n.yaml"
    bad.write_bytes(b"\xff\xfe bad")
    assert main(["train", "--config", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: preset {bad} is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"]


@pytest.mark.parametrize("flag", ["--prompt", "--stop"])
def test_non_utf8_prompt_or_stop_is_one_line(flag, tmp_path, capsys):
    """Python hands non-UTF-8 argv bytes over as lone surrogates (``surrogateescape``): refused, naming the byte,
    before the checkpoint is read (here there is none)."""
    text = b"ok\xff\xfe\x80abc".decode("utf-8", "surrogateescape")
    args = {"--prompt": "hello", "--stop": None}
    args[flag] = text
    argv = ["generate", "--checkpoint", str(tmp_path / "none")] + [a for k, v in args.items() if v for a in (k, v)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag} is not valid UTF-8 text (byte 0xff at offset 2); "), err


@pytest.mark.parametrize("command", ["generate", "eval ruler", "eval bench"])
def test_corrupt_run_tokenizer_gets_a_hint_for_the_command(command, tmp_path, capsys):
    """generate/eval read the tokenizer saved beside the checkpoint: the hint says to restore that folder, not
    the training-only ``data.tokenizer=train``; it is read (and refused) before the parameters."""
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    argv = {"generate": ["generate", "--checkpoint", str(run), "--prompt", "hi"],
            "eval ruler": ["eval", "ruler", str(run), "--out", str(tmp_path / "o"), "--lengths", "1024",
                           "--tasks", "niah_single_1", "--num-samples", "1", "--no-progress"],
            "eval bench": ["eval", "bench", str(run), "--data-dir", str(tmp_path), "--tasks", "gsm8k",
                           "--no-progress"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a valid SentencePiece model" in err[0], err
    assert "data.tokenizer" not in err[0] and f"; restore {run / 'tokenizer'} from the tokenizer" in err[0], err


@pytest.mark.parametrize("extra, refused", [
    (["--num-draft", "3"], "--num-draft shapes"),
    (["--num-draft", "5", "--draft-window", "8"], "--num-draft/--draft-window shape"),
    (["--fr-spec-vocab", "64"], "--fr-spec-vocab shapes"), ([], None)])
def test_draft_options_without_spec_decode_are_refused(extra, refused, tmp_path, capsys):
    """--num-draft without --spec-decode was silently ignored (its default must not trigger the refusal); all draft
    options are refused before the checkpoint is read (here there is none)."""
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "hi", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    if refused:
        assert err[0] == f"error: {refused} the draft of --spec-decode; add --spec-decode", err
    else:
        assert "does not exist" in err[0], err


def test_wsd_length_error_names_the_keys():
    with pytest.raises(ConfigError, match=r"optimizer.warmup_steps=30 .*lower optimizer.warmup_steps"):
        load_config("cpu_tiny", ["steps=12"])


@pytest.mark.parametrize("argv, flag", [
    (["import", "hf", "some_dir", "--out", "x", "--eagle", ""], "--eagle"),
    (["import", "hf", "", "--out", "x"], "DIR"),
    (["import", "hf", "some_dir", "--out", " "], "--out"),
    (["export", "eagle", "--checkpoint", "", "--out", "x"], "--checkpoint"),
    (["generate", "--checkpoint", "", "--prompt", "hi"], "--checkpoint"),
])
def test_empty_path_arguments_are_refused(argv, flag, capsys, tmp_path, monkeypatch):
    """An empty path would resolve to the current folder; it is refused with a line naming the argument, before
    anything is read or written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"{flag} is an empty path; give a folder")
    assert list(tmp_path.iterdir()) == []


def test_eval_keeps_its_empty_optional_checkpoint(capsys, tmp_path, monkeypatch):
    """``eval ruler ''`` (no checkpoint, scoring given predictions) is not caught by the empty-path check of the
    other commands: whatever it then says, it is not that error."""
    monkeypatch.chdir(tmp_path)
    try:
        main(["eval", "ruler", "", "--out", "o", "--predictions", "p.jsonl"])
    except SystemExit:
        pass
    assert "is an empty path" not in capsys.readouterr().err


def test_a_repeated_prompt_is_refused(tmp_path, capsys):
    """Thirteenth-session break test: ``--prompt a --prompt b`` continued only "b" (argparse keeps the last)."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a", "--prompt", "b"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--prompt given twice; generate continues one prompt per run")


@pytest.mark.parametrize("signum", [2, 15])
def test_an_interrupted_command_is_one_line(signum, capsys, monkeypatch):
    """Ctrl-C in `generate` / `export` / `eval` printed a KeyboardInterrupt traceback (through XLA's compile) and
    SIGTERM ended them silently with -15 (helper 65). Now: one line and 128 + the signal number; the SIGTERM
    handler is the default again when main returns."""
    import os
    import signal

    import minicpm4_jax.cli as cli

    def export_body(args):
        if signum == 15:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler main installed raises Terminated here
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_export", export_body)
    assert main(["export", "gguf", "--checkpoint", "runs/x", "--out", "y"]) == 128 + signum
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: export interrupted by {signal.Signals(signum).name}"], err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sigterm_inside_a_staged_export_is_the_one_line_too(capsys, monkeypatch):
    """Helper 67: export's staged write swapped the command's SIGTERM handler for its own SystemExit(143), so a
    SIGTERM there ended without the `interrupted` line. The staged write keeps a handler already set."""
    import os
    import signal

    import minicpm4_jax.cli as cli
    from minicpm4_jax.convert.io import _sigterm_raises

    def export_body(args):
        with _sigterm_raises():
            os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not interrupted")

    monkeypatch.setattr(cli, "_cmd_export", export_body)
    assert main(["export", "gguf", "--checkpoint", "runs/x", "--out", "y"]) == 143
    assert capsys.readouterr().err.strip().splitlines() == ["error: export interrupted by SIGTERM"]
    # outside the command (library use) the staged write still turns SIGTERM into SystemExit(143)
    with pytest.raises(SystemExit, match="143"):
        with _sigterm_raises():
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_closed_output_pipe_ends_the_command_quietly():
    """``minicpm4 generate ... | head -c 3`` ended with a BrokenPipeError traceback from the streamed print (and an
    "Exception ignored" line at exit). Now: nothing on stderr and the status of a SIGPIPE death, 141."""
    import subprocess
    import sys

    code = ("import sys, minicpm4_jax.cli as cli\n"
            "def body(args):\n"
            "    for _ in range(2000):\n"
            "        print('token ' * 50, end='', flush=True)\n"
            "    return 0\n"
            "cli._cmd_generate = body\n"
            "sys.exit(cli.main(['generate', '--checkpoint', 'x', '--prompt', 'p']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(3) == b"tok"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == "", err


def test_bad_native_linger_setting_stops_the_command_before_any_output(monkeypatch, tmp_path, capsys):
    # the kernel reads MINICPM4_JAX_NATIVE_LINGER_US with atoll ('abc' -> 0); the command refuses it up front
    monkeypatch.setenv("MINICPM4_JAX_NATIVE_LINGER_US", "1e3")
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip().splitlines() == [
        "error: MINICPM4_JAX_NATIVE_LINGER_US='1e3' must be a whole number of microseconds from 0 (no lingering pool "
        "thread) to 1000000; unset it for the default 1000"]
