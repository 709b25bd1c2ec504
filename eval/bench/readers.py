"""Readers for published benchmark files: JSONL, JSON, CSV, Parquet (optionally gzip-compressed).

Every record comes back as a ``dict`` with an extra key ``"_where"`` = ``"file:line"`` (JSONL
line, CSV line, ``file:record N`` for JSON/Parquet) so that later checks can name the exact
place of a bad row. Malformed input raises :class:`DataError` whose message is one line naming
the file and line.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

WHERE = "_where"


class DataError(ValueError):
    """A benchmark file or row is malformed; ``str(e)`` is one line naming file and line."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def open_text(path: Path) -> io.TextIOBase:
    """``path`` opened as UTF-8 text (a BOM dropped, newlines untranslated for :mod:`csv`); a ``.gz`` name is read
    through gzip."""
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext in ("jsonl", "json", "csv", "parquet"):
        if name.endswith("." + ext):
            return ext
    raise DataError(f"{path}: unsupported file type (expected .jsonl, .json, .csv or .parquet, optionally .gz)")


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: invalid JSON ({_one_line(e.msg)} at column {e.colno})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
                rec[WHERE] = f"{path}:{n}"
                out.append(rec)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None
    return out


def read_json(path: Path, field: str | None = None) -> list[dict] | dict:
    """A JSON list of objects, or an object; ``field`` picks the list from a top-level key.

    Without ``field`` a top-level object is returned as is (e.g. BBH's ``cot_prompts.json``).
    """
    try:
        with open_text(path) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({_one_line(e.msg)} at column {e.colno})") from None
    if field is not None:
        if not isinstance(data, dict) or field not in data:
            raise DataError(f"{path}:1: expected a top-level object with key {field!r}")
        data = data[field]
    if isinstance(data, dict) and field is None:
        return data
    if not isinstance(data, list):
        raise DataError(f"{path}:1: expected a list of records, got {type(data).__name__}")
    # line of each record: locate record starts by scanning for top-level objects is costly;
    # record index is exact and cheap.
    out = []
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise DataError(f"{path}:record {i + 1}: expected a JSON object, got {type(rec).__name__}")
        rec = dict(rec)
        rec[WHERE] = f"{path}:record {i + 1}"
        out.append(rec)
    return out


def read_csv(path: Path, *, header: bool | None = None, fieldnames: Sequence[str] | None = None) -> list[dict]:
    """CSV with standard quoting. ``header=None`` uses the first row as the header.

    With ``header=False`` the columns are named by ``fieldnames`` (or ``"0", "1", ...``). Every
    row must have as many fields as the header; the error names the physical line.
    """
    out = []
    try:
        with open_text(path) as f:
            reader = csv.reader(f, strict=True)
            names: list[str] | None = list(fieldnames) if fieldnames is not None else None
            start = reader.line_num
            for row in reader:
                line = start + 1
                start = reader.line_num
                if names is None:
                    if header is False:
                        names = [str(i) for i in range(len(row))]
                    else:
                        names = [c.strip() for c in row]
                        if len(set(names)) != len(names):
                            raise DataError(f"{path}:{line}: duplicate column names in the header {names}")
                        continue
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != len(names):
                    raise DataError(f"{path}:{line}: expected {len(names)} fields ({','.join(names)}), got {len(row)}")
                rec: dict[str, Any] = dict(zip(names, row))
                rec[WHERE] = f"{path}:{line}"
                out.append(rec)
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: malformed CSV ({_one_line(e)})") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({_one_line(e)})") from None
    return out


def read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow") from None
    except Exception as e:  # pyarrow raises its own error types
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
    out = []
    for i, rec in enumerate(table.to_pylist()):
        rec[WHERE] = f"{path}:row {i + 1}"
        out.append(rec)
    return out


def read_records(path: str | Path, *, field: str | None = None, csv_header: bool | None = None,
                 csv_fieldnames: Sequence[str] | None = None) -> list[dict]:
    """Records of one file, dispatched on its extension (``.jsonl/.json/.csv/.parquet`` [``.gz``])."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    kind = _kind(path)
    if kind == "jsonl":
        return read_jsonl(path)
    if kind == "json":
        data = read_json(path, field)
        if isinstance(data, dict):
            raise DataError(f"{path}:1: expected a list of records (or pass the key that holds them)")
        return data
    if kind == "csv":
        return read_csv(path, header=csv_header, fieldnames=csv_fieldnames)
    return read_parquet(path)


def require(records: Iterable[dict], fields: Sequence[str], what: str = "") -> None:
    """Every record has every field (non-null); else a one-line error naming file and line."""
    for rec in records:
        for f in fields:
            if f not in rec or rec[f] is None:
                have = sorted(k for k in rec if k != WHERE)
                raise DataError(f"{rec.get(WHERE, '?')}: missing field {f!r}{' for ' + what if what else ''} "
                                f"(fields present: {', '.join(have)})")


def require_text(records: Iterable[dict], fields: Sequence[str], what: str = "") -> None:
    """Every record has every field as a string (what a prompt or program is built from); else a one-line error
    naming file, line and the field's type (a number or list there would fail later, deep in the tokenizer)."""
    require(records, fields, what)
    for rec in records:
        for f in fields:
            if not isinstance(rec[f], str):
                raise bad(rec, f"field {f!r}{' for ' + what if what else ''} must be text, got "
                               f"{type(rec[f]).__name__} {_one_line(repr(rec[f]))[:60]}")


def bad(rec: dict, msg: str) -> DataError:
    """A :class:`DataError` for ``rec`` (prefixed with its file:line)."""
    return DataError(f"{rec.get(WHERE, '?')}: {_one_line(msg)}")


def find_files(directory: Path, patterns: Sequence[str]) -> list[Path]:
    """Files under ``directory`` matching any glob pattern, sorted by name (deterministic)."""
    seen: dict[Path, None] = {}
    for pat in patterns:
        for p in sorted(directory.glob(pat)):
            if p.is_file():
                seen[p] = None
    return sorted(seen)
