"""scripts/build_fr_spec.py's bad input: one ``error:`` line and exit status 2, no traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from test_convert_common import tiny_tokenizer_dir  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def build_fr_spec():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_fr_spec

        yield build_fr_spec
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_out_that_is_a_file_is_one_line(build_fr_spec, tiny_tokenizer_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(tiny_tokenizer_dir, run / "tokenizer")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a folder\n")
    capsys.readouterr()
    rc = build_fr_spec.main(["--checkpoint", str(run), "--sources", str(corpus), "--size", "8", "--no-pt",
                             "--out", str(blocker)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and str(blocker) in err[0], err
    assert blocker.read_text() == "a file, not a folder\n"
    # the same call with a usable folder writes the ranking (the ids the file holds are 8 distinct ids)
    assert build_fr_spec.main(["--checkpoint", str(run), "--sources", str(corpus), "--size", "8", "--no-pt",
                               "--out", str(tmp_path / "fr")]) == 0
    ids = [int(x) for x in (tmp_path / "fr" / "freq_8.txt").read_text().split()]
    assert len(ids) == len(set(ids)) == 8
