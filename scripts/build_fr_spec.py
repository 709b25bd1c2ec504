"""Build an FR-Spec frequency-ranked token list for a run's tokenizer (paper §4.1; spec §7).

Tokenizes a corpus with the run's tokenizer, ranks token ids by frequency (ties: lower id first), keeps the
``--size`` most frequent, puts EOS in if it is missing (replacing the last entry, as the official generator
does), and writes

* ``freq_{size}.txt``: the project's plain format (one id per line, most frequent first), read by
  ``minicpm4 generate --fr-spec FILE``;
* ``freq_{size}.pt``: the official format (``torch.save`` of a plain Python list) that CPM.cu loads with
  ``torch.load(weights_only=True)``; written by the Python 3.11 torch environment (``.venv-torch``, built by
  ``make torch-env``), which also loads it back. Skipped with a message when that environment is absent or
  with ``--no-pt``.

Default corpus: the run's own training sources (``data.sources`` of its ``config.json``); the official files
use 1M lines of wikitext-103, so pass ``--sources`` to rank on other text.

    .venv/bin/python scripts/build_fr_spec.py --checkpoint runs/cpu_tiny --size 2048 --out runs/cpu_tiny/fr_spec
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from minicpm4_jax.argtypes import DefaultsHelpFormatter, int_range
    from minicpm4_jax.config import ConfigError, DataConfig, config_from_dict
    from minicpm4_jax.infer.spec import build_frequency_ranking, save_frequency_ranking
    from minicpm4_jax.tokenizer import load_tokenizer
    from minicpm4_jax.train.data import read_corpus

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a run folder (holding tokenizer/ and config.json)")
    ap.add_argument("--sources", nargs="+", default=None, help="corpus paths (default: the run's data.sources)")
    ap.add_argument("--size", type=int_range(1), default=8192, help="V', the draft vocabulary size (default 8192)")
    ap.add_argument("--out", default=None, help="output folder (default <checkpoint>/fr_spec)")
    ap.add_argument("--no-pt", action="store_true", help="do not write the official torch .pt file")
    ap.add_argument("--torch-python", default=str(REPO / ".venv-torch" / "bin" / "python"),
                    help="python of the torch environment (default .venv-torch/bin/python)")
    args = ap.parse_args(argv)
    try:
        run = Path(args.checkpoint)
        tok_dir = run / "tokenizer"
        if not tok_dir.is_dir():
            raise ConfigError(f"{tok_dir} does not exist; pass a run folder written by minicpm4 train or import")
        tok = load_tokenizer(str(tok_dir), fix=f"restore {tok_dir} from the tokenizer the model was trained with")
        cfg_path = run / "config.json"
        if args.sources:
            data_cfg = DataConfig(sources=tuple(args.sources))
        elif cfg_path.is_file():
            data_cfg = config_from_dict(json.loads(cfg_path.read_text())).data
        else:
            raise ConfigError(f"{cfg_path} does not exist; pass --sources")
        vocab = tok.vocab_size
        corpus = read_corpus(dataclasses.replace(data_cfg))
        streams = (tok.encode(doc) for doc in corpus.documents)
        ids = build_frequency_ranking(streams, args.size, vocab, eos_id=tok.eos_id)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run / "fr_spec"
    try:
        txt = save_frequency_ranking(ids, out / f"freq_{args.size}.txt")
    except OSError as e:  # --out a file, an unwritable folder, a full disk: one line, no traceback
        print(f"error: cannot write the ranking under --out {out}: {e.strerror or e}; pass a writable folder",
              file=sys.stderr)
        return 2
    print(f"wrote {txt} ({len(ids)} of {vocab} ids, {len(corpus.documents)} documents)")
    if args.no_pt:
        return 0
    py = Path(args.torch_python)
    if not py.exists():
        print(f"skipped freq_{args.size}.pt: no torch environment at {py} (run `make torch-env`)", file=sys.stderr)
        return 0
    pt = out / f"freq_{args.size}.pt"
    proc = subprocess.run([str(py), str(REPO / "scripts" / "torch_side.py"), "fr-spec-pt", "--ids-txt", str(txt),
                           "--out", str(pt)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: writing {pt} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"wrote {pt}: {proc.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
