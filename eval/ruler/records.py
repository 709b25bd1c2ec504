"""RULER's JSONL files: data records and prediction records, read and written in upstream's format.

Data record (``<task>/validation.jsonl``, one JSON object per line, written like upstream's
``write_manifest``: ``json.dump`` defaults, ASCII-escaped, ``\\n`` after each):
``index, input, outputs, length, length_w_model_temp, answer_prefix`` (+ ``token_position_answer`` for NIAH,
+ ``others`` here). A model is given ``input + answer_prefix``.

Prediction record (upstream ``call_api.py``): ``index, pred, input`` (= ``input + answer_prefix``),
``outputs, others, truncation, length`` (+ ``truncated`` here).

Files from other implementations load as long as each line has ``input`` (data) or ``pred`` (predictions)
and ``outputs``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from minicpm4_jax.config import ConfigError

__all__ = ["read_text", "write_jsonl", "read_jsonl", "read_data", "read_predictions", "prediction_record", "dumps_record"]


def read_text(path: str | os.PathLike, what: str = "", fix: str = "") -> str:
    """The UTF-8 text of a user's input file.

    Raises:
        ConfigError: one line naming ``what`` and the file: unreadable (``fix`` appended, if given), or not
            UTF-8 (naming the first bad byte).
    """
    p = Path(path)
    name = f"{what} {p}" if what else str(p)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{name}: cannot read ({e.strerror or e}){'; ' + fix if fix else ''}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None


def dumps_record(rec: dict[str, Any]) -> str:
    """One line as upstream writes it (``json.dumps`` defaults: ``", "``/``": "``, ASCII escapes)."""
    return json.dumps(rec, ensure_ascii=True) + "\n"


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write records to ``path`` (parents created; written to a temporary name, then renamed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(dumps_record(rec))
    os.replace(tmp, p)
    return p


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All JSON objects of a JSONL file (blank lines skipped).

    Raises:
        ConfigError: unreadable file, or a line that is not a JSON object (names file and line).
    """
    p = Path(path)
    lines = read_text(p).splitlines()
    out = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{no}: invalid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{p}:{no}: expected a JSON object per line")
        out.append(rec)
    return out


def _check(p: Path, no: int, rec: dict[str, Any], fields: tuple[str, ...]) -> None:
    for f in fields:
        if f not in rec:
            raise ConfigError(f"{p}:{no}: record lacks the field {f!r} (RULER record format)")
    outs = rec["outputs"]
    if not isinstance(outs, list) or not outs or not all(isinstance(o, str) for o in outs):
        raise ConfigError(f"{p}:{no}: 'outputs' must be a non-empty list of strings")


def read_data(path: str | os.PathLike) -> list[dict[str, Any]]:
    """RULER data records (``input``, ``outputs``, ``index`` required; validated).

    Raises:
        ConfigError: as :func:`read_jsonl`, or a record missing a required field (names file and line).
    """
    p = Path(path)
    recs = read_jsonl(p)
    for no, rec in enumerate(recs, start=1):
        _check(p, no, rec, ("index", "input", "outputs"))
        if not isinstance(rec["input"], str) or not isinstance(rec.get("answer_prefix", ""), str):
            raise ConfigError(f"{p}:{no}: 'input'/'answer_prefix' must be strings")
    return recs


def read_predictions(path: str | os.PathLike) -> list[dict[str, Any]]:
    """RULER prediction records (``pred`` and ``outputs`` required; validated).

    Raises:
        ConfigError: as :func:`read_jsonl`, or a record missing ``pred``/``outputs`` (names file and line).
    """
    p = Path(path)
    recs = read_jsonl(p)
    for no, rec in enumerate(recs, start=1):
        _check(p, no, rec, ("pred", "outputs"))
        if not isinstance(rec["pred"], str):
            raise ConfigError(f"{p}:{no}: 'pred' must be a string")
    return recs


def prediction_record(data: dict[str, Any], pred: str, *, truncated: bool = False) -> dict[str, Any]:
    """The prediction record of a data record, as upstream's ``call_api.py`` writes it (+ ``truncated``)."""
    return {
        "index": data["index"],
        "pred": pred,
        "input": data["input"] + data.get("answer_prefix", ""),
        "outputs": data["outputs"],
        "others": data.get("others", {}),
        "truncation": data.get("truncation", -1),
        "length": data.get("length", -1),
        "truncated": bool(truncated),
    }
