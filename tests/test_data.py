"""Data pipeline: readers, token cache (invalidation, atomicity), split, grain serving/resume, baselines, bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from minicpm4_jax.config import ConfigError, DataConfig
from minicpm4_jax.train.data import (
    corpus_entropies,
    default_cache_dir,
    heldout_ngram_xent,
    prepare_data,
    read_corpus,
    train_iterator,
    val_batches,
)

WORDS = ["def", "return", "self", "value", "data", "import", "class", "for", "in", "if", "else", "print",
         "x", "y", "0", "1", "42", "None", "True", "(", ")", ":", "=", "+", "[", "]", "'hello'", "你好",
         "name", "_private", "range", "len", "alpha", "beta", "gamma", "delta"]


def _doc(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        indent = rng.choice(["", "    ", "        ", "\t"])
        lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 12))))
    return "\n".join(lines) + "\n"


def _docs(n: int, seed: int = 0, n_lines: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [_doc(rng, n_lines) for _ in range(n)]


def _txt_corpus(d: Path, n: int = 30, seed: int = 0) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    docs = _docs(n, seed)
    for i, t in enumerate(docs):
        (d / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
    return docs


def _cfg(tmp_path: Path, sources, **kw) -> DataConfig:
    base = dict(
        sources=tuple(str(s) for s in sources), tokenizer_vocab_size=400, seq_len=32, batch_size=4,
        val_fraction=0.1, seed=0, cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return DataConfig(**base)


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture
def prepared(tmp_path):
    _txt_corpus(tmp_path / "corpus")
    cfg = _cfg(tmp_path, [tmp_path / "corpus"])
    return cfg, prepare_data(cfg, log=_quiet)


# ------------------------------------------------------------------------------------------------
# preparation, split, round trip
# ------------------------------------------------------------------------------------------------


def test_prepare_txt_folder_roundtrip_and_split(tmp_path, prepared):
    cfg, data = prepared
    man = data.manifest
    assert data.train_tokens.dtype == np.uint16 and data.train_tokens.ndim == 1
    assert man["num_documents"] == 30 and man["val_split"] == "documents"
    assert man["num_train_documents"] + man["num_val_documents"] == 30 and man["num_val_documents"] >= 1
    assert man["num_train_tokens"] == data.train_tokens.shape[0] and man["num_val_tokens"] == data.val_tokens.shape[0]
    assert man["skipped_files"] == 0 and man["tokenizer_hash"] == data.tokenizer.file_hash
    eos = data.tokenizer.eos_id
    # every document is followed by EOS, and decoding the segments gives the documents back exactly
    docs = sorted(p.read_text(encoding="utf-8") for p in (tmp_path / "corpus").glob("*.txt"))
    got = []
    for toks in (data.train_tokens, data.val_tokens):
        arr = np.asarray(toks)
        assert arr[-1] == eos
        cuts = np.flatnonzero(arr == eos)
        starts = np.concatenate([[0], cuts[:-1] + 1])
        got.append([data.tokenizer.decode(arr[s:e].tolist()) for s, e in zip(starts, cuts)])
    train_docs, val_docs = got
    assert sorted(train_docs + val_docs) == docs
    # the split is by whole documents: no document is in both
    assert len(val_docs) == man["num_val_documents"] and not set(train_docs) & set(val_docs)
    assert str(data.cache_dir).startswith(cfg.cache_dir)


def test_validation_split_is_deterministic_and_seeded(tmp_path):
    _txt_corpus(tmp_path / "corpus", n=40)
    a = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], seed=0), log=_quiet)
    b = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], seed=0, cache_dir=str(tmp_path / "c2")), log=_quiet)
    c = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], seed=1), log=_quiet)
    assert np.array_equal(a.val_tokens, b.val_tokens) and np.array_equal(a.train_tokens, b.train_tokens)
    assert a.manifest["key"] == b.manifest["key"] != c.manifest["key"]
    assert not np.array_equal(a.val_tokens, c.val_tokens)


def test_single_document_uses_tail_split(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("".join(_docs(20)), encoding="utf-8")
    data = prepare_data(_cfg(tmp_path, [p]), log=_quiet)
    assert data.manifest["val_split"] == "tail"
    frac = data.manifest["num_val_tokens"] / (data.manifest["num_val_tokens"] + data.manifest["num_train_tokens"])
    assert 0.05 < frac < 0.15


# ------------------------------------------------------------------------------------------------
# readers
# ------------------------------------------------------------------------------------------------


def test_jsonl_reader(tmp_path):
    docs = _docs(6)
    p = tmp_path / "c.jsonl"
    recs = [{"id": i, "content": d} for i, d in enumerate(docs)] + [{"id": 99}]
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in recs) + "\n\n", encoding="utf-8")
    assert read_corpus(_cfg(tmp_path, [p], text_field="content")).documents == docs


def test_records_without_the_text_field_are_counted_and_reported(tmp_path):
    """jsonl records without a string ``text_field`` (and parquet rows with none) were dropped silently (a 3-row
    file became "1 documents"); they are counted like non-UTF-8 files, named in the log line and the manifest; a
    file with records but none usable is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(30)
    p = tmp_path / "c.jsonl"
    rows = [{"text": d} for d in docs[:20]] + [{"content": "x"}, {"text": 42}, ["not", "an", "object"]]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    q = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs[20:] + [None]}), q)
    corpus = read_corpus(_cfg(tmp_path, [p, q]))
    assert corpus.documents == docs
    assert corpus.skipped_records == [f"{p}:21", f"{p}:22", f"{p}:23", f"{q}:row 11"]
    logs: list[str] = []
    man = prepare_data(_cfg(tmp_path, [p, q]), log=logs.append).manifest
    assert man["skipped_records"] == 4 and man["skipped_record_examples"][0] == f"{p}:21"
    line = next(m for m in logs if m.startswith("data: "))
    assert f"30 documents (4 records without a string 'text' field, skipped: first at {p}:21;" in line, line
    (tmp_path / "none.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError, match="has no string field 'text' in any record"):
        read_corpus(_cfg(tmp_path, [tmp_path / "none.jsonl"]))
    # break test 62: the field exists but holds numbers; the message said it was missing and to rename it
    (tmp_path / "num.jsonl").write_text(json.dumps({"text": 7}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(ConfigError, match=r"num.jsonl: field 'text' holds no string in any record \(e.g. "
                                          r".*num.jsonl:1\); give records whose text is a JSON string"):
        read_corpus(_cfg(tmp_path, [tmp_path / "num.jsonl"]))
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(ConfigError, match="has no string value in column 'text' \\(2 rows\\)"):
        read_corpus(_cfg(tmp_path, [tmp_path / "none.parquet"]))


def test_parquet_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(5)
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs + [None], "n": list(range(6))}), p)
    assert read_corpus(_cfg(tmp_path, [p])).documents == docs
    with pytest.raises(ConfigError, match="no column 'body'.*data.text_field"):
        read_corpus(_cfg(tmp_path, [p], text_field="body"))


def _save_to_disk_like(d: Path, shards: list[list[str]]) -> None:
    import pyarrow as pa

    d.mkdir(parents=True)
    files = []
    for i, texts in enumerate(shards):
        name = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        table = pa.table({"text": texts, "label": list(range(len(texts)))})
        with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        files.append({"filename": name})
    (d / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    (d / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "abc", "_split": "train"}))


def test_save_to_disk_reader(tmp_path):
    docs = _docs(7)
    _save_to_disk_like(tmp_path / "ds", [docs[:4], docs[4:]])
    assert read_corpus(_cfg(tmp_path, [tmp_path / "ds"])).documents == docs
    # a DatasetDict folder uses its train split
    dd = tmp_path / "dd"
    _save_to_disk_like(dd / "train", [docs[:2]])
    _save_to_disk_like(dd / "test", [docs[2:3]])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert read_corpus(_cfg(tmp_path, [dd])).documents == docs[:2]


def test_mixed_folder_sorted_and_skips_non_utf8(tmp_path):
    d = tmp_path / "mix"
    d.mkdir()
    docs = _docs(3)
    (d / "b.txt").write_text(docs[1], encoding="utf-8")
    (d / "a.txt").write_text(docs[0], encoding="utf-8")
    (d / "sub").mkdir()
    (d / "sub" / "c.jsonl").write_text(json.dumps({"text": docs[2]}) + "\n", encoding="utf-8")
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "ignored.csv").write_text("x,y")
    c = read_corpus(_cfg(tmp_path, [d]))
    assert c.documents == docs  # a.txt, b.txt, (empty, latin1 skipped), sub/c.jsonl
    assert c.skipped_files == [str(d / "latin1.txt")] and c.empty_files == [str(d / "empty.txt")]


# ------------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------------


def test_cache_reused_when_unchanged_and_rebuilt_when_a_byte_changes(tmp_path):
    _txt_corpus(tmp_path / "corpus")
    cfg = _cfg(tmp_path, [tmp_path / "corpus"])
    logs: list[str] = []
    a = prepare_data(cfg, log=logs.append)
    bin_a = a.cache_dir / "train.bin"
    mtime = bin_a.stat().st_mtime_ns
    b = prepare_data(cfg, log=logs.append)
    assert b.cache_dir == a.cache_dir and bin_a.stat().st_mtime_ns == mtime
    assert any("reusing token cache" in m for m in logs)
    assert b.manifest == a.manifest
    # change one byte of one document
    p = tmp_path / "corpus" / "doc007.txt"
    raw = bytearray(p.read_bytes())
    raw[10] = ord("Q") if raw[10] != ord("Q") else ord("R")
    p.write_bytes(bytes(raw))
    c = prepare_data(cfg, log=logs.append)
    assert c.manifest["corpus_hash"] != a.manifest["corpus_hash"]
    assert c.cache_dir != a.cache_dir and c.manifest["key"] != a.manifest["key"]
    # a different tokenizer (vocab size) also rebuilds
    d = prepare_data(dataclasses.replace(cfg, tokenizer_vocab_size=420), log=logs.append)
    assert d.manifest["tokenizer_hash"] != c.manifest["tokenizer_hash"] and d.cache_dir != c.cache_dir
    # sixth break test: a size below byte fallback's was reported as "tokenizer vocab_size=0", not by its key
    with pytest.raises(ConfigError, match=r"^data.tokenizer_vocab_size=0 is too small for the trained tokenizer"):
        prepare_data(dataclasses.replace(cfg, tokenizer_vocab_size=0), log=logs.append)


def test_incomplete_cache_is_rebuilt_not_reused(tmp_path, prepared):
    cfg, data = prepared
    (data.cache_dir / "val.bin").write_bytes(b"\x00\x00")  # truncated / tampered
    logs: list[str] = []
    again = prepare_data(cfg, log=logs.append)
    assert any("rebuilding" in m for m in logs)
    assert again.manifest["num_val_tokens"] == data.manifest["num_val_tokens"]
    assert (again.cache_dir / "val.bin").stat().st_size == 2 * data.manifest["num_val_tokens"]
    # break test 85: bytes changed in place (same size) put ids outside the vocabulary: validation loss nan, then
    # an IndexError in the n-gram baselines; such an entry is rebuilt too
    val = again.cache_dir / "val.bin"
    expected = np.array(again.val_tokens)
    raw = bytearray(val.read_bytes())
    raw[100:104] = b"\xff\xff\xff\x7f"
    val.write_bytes(bytes(raw))
    logs.clear()
    rebuilt = prepare_data(cfg, log=logs.append)
    assert any("rebuilding" in m for m in logs)
    assert int(np.max(rebuilt.val_tokens)) < rebuilt.manifest["vocab_size"]
    assert np.array_equal(rebuilt.val_tokens, expected)
    # leftovers of a killed build (dead pid) are removed; they never look like a cache entry
    stale = again.cache_dir.parent / ".tmp-deadbeef-999999999-abc"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\x01\x00")
    prepare_data(cfg, log=_quiet)
    assert not stale.exists()


def test_a_build_in_progress_on_another_host_is_not_taken_for_a_killed_one(tmp_path, monkeypatch):
    """Break test (helper 99): the processes of a multi-host run prepare the data at the same time in a shared cache.
    The token cache's clean-up judged every ``.tmp-<key>-<pid>-*`` build folder by ``os.kill(pid, 0)`` on its own
    host, where another host's pid does not exist: the process that came second removed the first one's build in
    progress. Build folders now name their host; only this host's dead builds are removed."""
    import hashlib
    import os
    import socket

    import minicpm4_jax.train.data as data_mod

    own = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    other = "0" * 8 if own != "0" * 8 else "1" * 8
    tokens = tmp_path / "cache" / "tokens"
    tokens.mkdir(parents=True)
    dead_pid = 999999999  # no such process here: a killed build on this host, a live one on another
    elsewhere = tokens / f".tmp-{'ab' * 12}-{other}-{dead_pid}-x1y2z3"
    killed_here = tokens / f".tmp-{'cd' * 12}-{own}-{dead_pid}-x1y2z3"
    for d in (elsewhere, killed_here):
        d.mkdir()
        (d / "train.bin").write_bytes(b"\x01\x00")
    made: list[str] = []
    real_mkdtemp = data_mod.tempfile.mkdtemp

    def mkdtemp(*a, **k):
        path = real_mkdtemp(*a, **k)
        if Path(path).parent == tokens:
            made.append(Path(path).name)
        return path

    monkeypatch.setattr(data_mod.tempfile, "mkdtemp", mkdtemp)
    _txt_corpus(tmp_path / "corpus")
    data = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"]), log=_quiet)
    assert data.manifest["num_train_tokens"] > 0
    assert (elsewhere / "train.bin").is_file(), "another host's build in progress was removed"
    assert not killed_here.exists(), "a killed build of this host was left behind"
    # this build's own folder names its host and pid, so that other hosts leave it alone
    assert len(made) == 1 and made[0].split("-")[2:4] == [own, str(os.getpid())], made


def test_an_unchanged_cache_is_not_rescanned_and_one_changed_in_place_is_caught(tmp_path, prepared, monkeypatch):
    """Helper 90: every start read the whole token cache for its largest id (minutes for a multi-GB cache). The
    largest id is now recorded with each file's stamp (size, mtime, ctime, inode) and read again only when the stamp
    changed, or when the file was written too shortly before the record to tell a later write in the same
    timestamp tick apart; bytes changed in place (same size) are still caught and rebuilt."""
    import os

    import minicpm4_jax.train.data as data_mod

    cfg, data = prepared
    scans: list[str] = []
    real = data_mod._max_token
    monkeypatch.setattr(data_mod, "_max_token", lambda path, *a: scans.append(path.name) or real(path, *a))
    prepare_data(cfg, log=_quiet)  # files just written: scanned, and their record is not trusted yet
    prepare_data(cfg, log=_quiet)
    assert scans == ["train.bin", "val.bin"] * 2
    old = data.cache_dir.stat().st_mtime_ns - 10 * 10**9  # as if written 10 s before
    for name in ("train.bin", "val.bin"):
        os.utime(data.cache_dir / name, ns=(old, old))
    scans.clear()
    logs: list[str] = []
    first = prepare_data(cfg, log=logs.append)
    again = prepare_data(cfg, log=logs.append)
    assert scans == ["train.bin", "val.bin"]  # once, then from the record
    assert sum("reusing token cache" in m for m in logs) == 2 and again.manifest == first.manifest
    val = data.cache_dir / "val.bin"
    expected = np.array(again.val_tokens)
    with open(val, "r+b") as f:  # in place: same size, same inode
        f.seek(100)
        f.write(b"\xff\xff\xff\x7f")
    scans.clear()
    logs.clear()
    rebuilt = prepare_data(cfg, log=logs.append)
    assert scans[0] == "val.bin" and any("rebuilding" in m for m in logs)
    assert np.array_equal(rebuilt.val_tokens, expected)


def test_verified_records_written_at_once_do_not_share_a_temporary_file(tmp_path, monkeypatch):
    """Earlier sessions: the token cache's verified.json was written through a temporary file named by the pid alone;
    a second writer with the same pid (another thread, a host sharing the cache) wrote into the first one's file and
    renamed it away, so the first writer's record was lost (its rename failed, silently). Each writer has its own
    temporary file now: the last rename wins with a whole record, and none is left behind."""
    import os
    import threading

    import minicpm4_jax.train.data as data_mod

    real, renamed = os.replace, []

    def replace(src, dst):
        if not renamed:  # the first writer is interrupted just before its rename by a second one
            renamed.append(None)
            other = threading.Thread(target=data_mod._record_verified, args=(tmp_path, {"val.bin": {"max_id": 2}}))
            other.start()
            other.join()
        renamed.append(json.loads(Path(src).read_text()))
        real(src, dst)

    monkeypatch.setattr(data_mod.os, "replace", replace)
    data_mod._record_verified(tmp_path, {"train.bin": {"max_id": 1}})
    assert renamed == [None, {"val.bin": {"max_id": 2}}, {"train.bin": {"max_id": 1}}]
    assert json.loads((tmp_path / "verified.json").read_text()) == {"train.bin": {"max_id": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["verified.json"]


def test_a_token_file_written_during_its_scan_is_scanned_again(tmp_path, prepared, monkeypatch):
    """Break test (helper 95): verified.json recorded the stamp taken *after* the scan (minutes on a multi-GB cache),
    so bytes written into a part the pass had already read (ids outside the vocabulary) were recorded as checked with
    the file's new stamp, and every later start trusted the stale largest id. The stamp (and time) of the record are
    those taken before the scan: the file no longer matches them and is scanned again."""
    import os
    import time as time_mod
    import types

    import minicpm4_jax.train.data as data_mod

    cfg, data = prepared
    old = data.cache_dir.stat().st_mtime_ns - 10 * 10**9  # files written 10 s ago: their record would be trusted
    for name in ("train.bin", "val.bin"):
        os.utime(data.cache_dir / name, ns=(old, old))
    (data.cache_dir / "verified.json").unlink(missing_ok=True)
    skew = [0]
    monkeypatch.setattr(data_mod, "time", types.SimpleNamespace(
        time_ns=lambda: time_mod.time_ns() + skew[0], perf_counter=time_mod.perf_counter))
    real = data_mod._max_token

    def slow_scan_with_a_write(path, *a):
        top = real(path, *a)
        if path.name == "val.bin":  # a stray write into bytes the pass already read; the scan ends 10 s later
            with open(path, "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xff\xff\x7f")
            skew[0] = 10 * 10**9
        return top

    monkeypatch.setattr(data_mod, "_max_token", slow_scan_with_a_write)
    prepare_data(cfg, log=_quiet)
    monkeypatch.setattr(data_mod, "_max_token", real)
    logs: list[str] = []
    again = prepare_data(cfg, log=logs.append)
    assert any("rebuilding" in m for m in logs), logs
    assert int(np.max(again.val_tokens)) < again.manifest["vocab_size"]


def test_tokenizer_path_source(tmp_path, prepared):
    cfg, data = prepared
    tok_dir = tmp_path / "tok"
    data.tokenizer.save(tok_dir)
    cfg2 = dataclasses.replace(cfg, tokenizer=str(tok_dir / "tokenizer.model"), cache_dir=str(tmp_path / "c2"))
    d2 = prepare_data(cfg2, log=_quiet)
    assert np.array_equal(d2.train_tokens, data.train_tokens)
    cfg3 = dataclasses.replace(cfg2, tokenizer=str(tok_dir / "tokenizer.json"))
    d3 = prepare_data(cfg3, log=_quiet)
    assert np.array_equal(d3.train_tokens, data.train_tokens)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_data(dataclasses.replace(cfg, tokenizer=str(tmp_path / "nope.model")), log=_quiet)


def test_large_vocab_tokenizer_uses_uint32(tmp_path):
    from conftest import shared_path

    official = shared_path("data", "minicpm4-0.5b")
    _txt_corpus(tmp_path / "corpus", n=10)
    data = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], tokenizer=str(official)), log=_quiet)
    assert data.tokenizer.vocab_size == 73448 and data.train_tokens.dtype == np.uint32
    assert data.manifest["eos_id"] == 2 and int(data.train_tokens[-1]) == 2


def test_default_cache_dir_is_in_repo(repo_root):
    assert default_cache_dir() == repo_root / ".cache" / "data"


# ------------------------------------------------------------------------------------------------
# serving
# ------------------------------------------------------------------------------------------------


def _rows(batch) -> list[bytes]:
    return [r.tobytes() for r in batch["input_ids"]]


def test_train_iterator_batches(prepared):
    cfg, data = prepared
    it = train_iterator(data, cfg)
    b = next(it)
    assert set(b) == {"input_ids"}
    assert b["input_ids"].shape == (cfg.batch_size, cfg.seq_len + 1) and b["input_ids"].dtype == np.int32
    # rows are windows of the train stream at multiples of seq_len
    stream = np.asarray(data.train_tokens, dtype=np.int32)
    for row in b["input_ids"]:
        starts = [s for s in range(0, stream.size - cfg.seq_len, cfg.seq_len) if np.array_equal(stream[s : s + cfg.seq_len + 1], row)]
        assert starts
    # one epoch visits every window once; the next epoch is another permutation
    n_windows = (data.train_tokens.shape[0] - 1) // cfg.seq_len
    it1 = train_iterator(data, cfg, num_epochs=1)
    epoch = [r for batch in it1 for r in _rows(batch)]
    assert len(epoch) == (n_windows // cfg.batch_size) * cfg.batch_size and len(set(epoch)) == len(epoch)
    it2 = train_iterator(data, cfg, num_epochs=2)
    both = [r for batch in it2 for r in _rows(batch)]
    assert both[: len(epoch)] == epoch and both[len(epoch) :] != epoch
    # same seed, same order; another seed, another order
    again = train_iterator(data, cfg)
    assert _rows(next(again)) == _rows(b)
    other = train_iterator(data, dataclasses.replace(cfg, seed=5))
    assert _rows(next(other)) != _rows(b)


def test_train_iterator_get_set_state(prepared):
    cfg, data = prepared
    it = train_iterator(data, cfg)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [_rows(next(it)) for _ in range(2)]
    fresh = train_iterator(data, cfg)
    fresh.set_state(state)
    assert [_rows(next(fresh)) for _ in range(2)] == want


def test_train_iterator_orbax_checkpoint_resume(tmp_path, prepared):
    import grain
    import orbax.checkpoint as ocp

    cfg, data = prepared
    it = train_iterator(data, cfg)
    for _ in range(3):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    want = [_rows(next(it)) for _ in range(2)]
    fresh = train_iterator(data, cfg)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(fresh)))
    resumed = restored["data_iter"]
    assert [_rows(next(resumed)) for _ in range(2)] == want


def test_per_process_sharding_disjoint_and_global_order(prepared):
    cfg, data = prepared
    single = train_iterator(data, cfg, num_epochs=1)
    shards = [train_iterator(data, cfg, process_index=p, process_count=2, num_epochs=1) for p in range(2)]
    seen: list[set[bytes]] = [set(), set()]
    for g in single:
        parts = [next(s) for s in shards]
        for p, part in enumerate(parts):
            assert part["input_ids"].shape == (cfg.batch_size // 2, cfg.seq_len + 1)
            seen[p].update(_rows(part))
        # global batch k = union of the processes' batch k (interleaved)
        assert sorted(_rows(parts[0]) + _rows(parts[1])) == sorted(_rows(g))
    assert seen[0] and seen[1] and not (seen[0] & seen[1])
    with pytest.raises(ConfigError, match="not divisible by process_count=3"):
        train_iterator(data, cfg, process_index=0, process_count=3)
    with pytest.raises(ConfigError, match="process_index=2"):
        train_iterator(data, cfg, process_index=2, process_count=2)


def test_val_batches(prepared):
    cfg, data = prepared
    a = val_batches(data, cfg, 3)
    b = val_batches(data, cfg, 3)
    assert len(a) >= 1 and all(x.shape == (cfg.batch_size, cfg.seq_len + 1) and x.dtype == np.int32 for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    stream = np.asarray(data.val_tokens, dtype=np.int32)
    assert np.array_equal(a[0][1], stream[cfg.seq_len : 2 * cfg.seq_len + 1])
    big = dataclasses.replace(cfg, batch_size=10_000)
    (only,) = val_batches(data, big, 5)
    assert only.shape == ((stream.size - 1) // cfg.seq_len, cfg.seq_len + 1)


# ------------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------------


def test_corpus_entropies_known_values():
    cyc = np.tile(np.arange(4, dtype=np.uint16), 1000)
    h = corpus_entropies(cyc, 8)
    assert math.isclose(h["unigram"], math.log(4), rel_tol=1e-12)
    assert abs(h["bigram"]) < 1e-9  # the next token is determined by the previous one
    rng = np.random.default_rng(0)
    iid = rng.integers(0, 16, size=200_000)
    h = corpus_entropies(iid, 16)
    assert abs(h["unigram"] - math.log(16)) < 1e-3 and abs(h["bigram"] - math.log(16)) < 5e-3


def test_ngram_baselines_read_a_bounded_sample_of_a_large_corpus(tmp_path, monkeypatch):
    """Break test (helper 99): the end-of-run n-gram table read the whole train split into int64 arrays, ~54 bytes
    per token at its peak (1.1 GB for 20M tokens, so tens of GB for a real corpus), after the run's last checkpoint:
    such a run died there without summary.json, and so did every resume. Each split is now read through
    ``ngram_sample`` (at most NGRAM_MAX_TOKENS tokens, evenly spread runs), so memory does not grow with the
    corpus; a split that fits is read whole (the values are exact)."""
    import tracemalloc

    import minicpm4_jax.train.data as data_mod

    n, cap, vocab = 2_000_000, 8192, 4096
    mm = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=(n,))
    mm[:] = np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16)
    mm.flush()
    train = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="r", shape=(n,))
    monkeypatch.setattr(data_mod, "NGRAM_MAX_TOKENS", cap, raising=False)
    tracemalloc.start()
    try:
        ent = corpus_entropies(train, vocab)
        held = heldout_ngram_xent(train, train[: n // 50], vocab)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB traced for {n:,} tokens"  # the whole split: ~100 MiB
    # uniform ids: a plug-in entropy of 8192 of them lies a little below log(vocab); the held-out one above
    assert 0.9 * math.log(vocab) < ent["unigram"] < math.log(vocab) < held["unigram"]
    sample = data_mod.ngram_sample(train)
    assert sample.shape == (cap,) and np.array_equal(sample[:cap // 64], train[:cap // 64])
    assert np.array_equal(sample[-(cap // 64):], train[-(cap // 64):])  # spread up to the end
    # a split that fits is read whole: the same values as without the bound
    small = np.asarray(train[:cap])
    assert corpus_entropies(small, vocab) == corpus_entropies(small, vocab, max_tokens=cap * 10)


def test_heldout_ngram_xent_is_normalised_and_sensible():
    rng = np.random.default_rng(0)
    V = 12
    train = np.tile(np.array([0, 1, 2, 3, 1, 2], dtype=np.int64), 200)
    train = np.concatenate([train, rng.integers(0, 8, size=300)])  # ids 8..11 never seen
    for v in (0, 1, 9):  # seen and unseen histories
        total = sum(math.exp(-heldout_ngram_xent(train, np.array([v, w]), V)["bigram"]) for w in range(V))
        assert abs(total - 1.0) < 1e-9
    total_uni = sum(math.exp(-heldout_ngram_xent(train, np.array([w, w]), V)["unigram"]) for w in range(V))
    assert abs(total_uni - 1.0) < 1e-9
    val = np.tile(np.array([0, 1, 2, 3, 1, 2]), 20)
    x = heldout_ngram_xent(train, val, V)
    assert x["bigram"] < x["unigram"] and 0 < x["bigram_discount"] < 1


def test_baselines_on_prepared_data(prepared):
    _, data = prepared
    V = data.tokenizer.vocab_size
    h = corpus_entropies(data.train_tokens, V)
    x = heldout_ngram_xent(data.train_tokens, data.val_tokens, V)
    assert 0 < h["bigram"] < h["unigram"] < math.log(V)
    assert h["bigram"] < x["bigram"] < x["unigram"]


# ------------------------------------------------------------------------------------------------
# bad input: one-line ConfigError naming the value and the fix
# ------------------------------------------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_corpus_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, [tmp_path / "nope.txt"]), log=_quiet)
    assert "nope.txt" in _one_line(e) and "does not exist" in str(e.value)


def test_empty_corpus_file_and_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty.txt is empty") as e:
        prepare_data(_cfg(tmp_path, [tmp_path / "empty.txt"]), log=_quiet)
    _one_line(e)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ConfigError, match="holds no .txt/.jsonl/.parquet files") as e:
        prepare_data(_cfg(tmp_path, [tmp_path / "emptydir"]), log=_quiet)
    _one_line(e)
    with pytest.raises(ConfigError, match="unsupported type .csv"):
        (tmp_path / "x.csv").write_text("a,b")
        prepare_data(_cfg(tmp_path, [tmp_path / "x.csv"]), log=_quiet)


def test_no_decodable_text(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.txt").write_bytes(b"\xff\xfe caf\xe9")
    (d / "b.txt").write_bytes("cr\xe8me".encode("latin-1"))
    with pytest.raises(ConfigError, match="no decodable text .*2 not UTF-8") as e:
        prepare_data(_cfg(tmp_path, [d]), log=_quiet)
    _one_line(e)
    assert str(e.value).endswith("give UTF-8 text files")  # text files have no field to name (sixth break test)
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(ConfigError, match="no string field 'text'.*'body'.*data.text_field") as e:
        prepare_data(_cfg(tmp_path, [j]), log=_quiet)
    _one_line(e)
    j.write_text("{not json\n")
    with pytest.raises(ConfigError, match="c.jsonl:1 is not valid JSON"):
        prepare_data(_cfg(tmp_path, [j]), log=_quiet)


def test_unwritable_cache_dir(tmp_path):
    _txt_corpus(tmp_path / "corpus", n=3)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir=.*afile/cache is not a writable folder") as e:
        prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], cache_dir=str(blocker / "cache")), log=_quiet)
    _one_line(e)
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "minicpm4_cache"
    with pytest.raises(ConfigError, match="inside the Python installation"):
        prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], cache_dir=str(stdlib)), log=_quiet)
    assert not stdlib.exists()
    assert not (tmp_path / "cache").exists()  # nothing half-written anywhere


def test_corpus_smaller_than_one_window(tmp_path):
    _txt_corpus(tmp_path / "corpus", n=30)
    with pytest.raises(ConfigError, match=r"train split has \d+ tokens, fewer than one window of data.seq_len\+1=100001") as e:
        prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], seq_len=100_000), log=_quiet)
    _one_line(e)
    data = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], val_fraction=0.01), log=_quiet)
    n_val = data.manifest["num_val_tokens"]
    assert n_val < data.manifest["num_train_tokens"] - 1
    with pytest.raises(ConfigError, match="validation split has .* data.val_fraction"):
        prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], val_fraction=0.01, seq_len=n_val), log=_quiet)


def test_batch_larger_than_the_corpus(tmp_path):
    """Break test: data.batch_size=10000000 was accepted and the run was OOM-killed after writing its files. A batch
    of more windows than the train split holds (summed over a mixture's components) is one line; one that
    overflows int64 is refused before the corpus is read."""
    _txt_corpus(tmp_path / "corpus", n=30)
    data = prepare_data(_cfg(tmp_path, [tmp_path / "corpus"]), log=_quiet)
    n = data.manifest["num_train_tokens"]
    windows = (n - 1) // 32
    assert prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], batch_size=windows), log=_quiet).manifest == data.manifest
    for b in (windows + 1, 10_000_000):
        with pytest.raises(ConfigError) as e:
            prepare_data(_cfg(tmp_path, [tmp_path / "corpus"], batch_size=b), log=_quiet)
        _one_line(e)
        assert str(e.value) == (f"data.batch_size={b} x data.seq_len=32 = {b * 32:,} tokens per batch exceed the train "
                                f"split's {n:,} tokens ({windows:,} windows of data.seq_len+1=33); lower "
                                f"data.batch_size to at most {windows:,} or add text to data.sources")
    with pytest.raises(ConfigError, match=r"^data.batch_size=10{20} x \(data.seq_len\+1=33\) tokens per batch overflow "
                                          r"a 64-bit integer"):
        prepare_data(_cfg(tmp_path, [tmp_path / "nowhere"], batch_size=10**20), log=_quiet)  # never read
    # a mixture: its components' windows together
    _txt_corpus(tmp_path / "other", n=30, seed=1)
    mix = dict(weights=(1.0, 1.0))
    both = prepare_data(_cfg(tmp_path, [tmp_path / "corpus", tmp_path / "other"], **mix), log=_quiet)
    total = sum((c.data.manifest["num_train_tokens"] - 1) // 32 for c in both.components)
    assert total > windows
    prepare_data(_cfg(tmp_path, [tmp_path / "corpus", tmp_path / "other"], batch_size=total, **mix), log=_quiet)
    with pytest.raises(ConfigError, match=f"lower data.batch_size to at most {total:,} or add text"):
        prepare_data(_cfg(tmp_path, [tmp_path / "corpus", tmp_path / "other"], batch_size=total + 1, **mix),
                     log=_quiet)


# ------------------------------------------------------------------------------------------------
# the real default corpus
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stdlib_corpus(tmp_path):
    root = Path(sysconfig.get_paths()["stdlib"])
    expected_bad = 0
    for p in root.rglob("*.py"):
        if {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts):
            continue
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            expected_bad += 1
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, log=_quiet)
    man = data.manifest
    assert man["skipped_files"] == expected_bad == len(man["skipped_file_paths"])
    assert man["num_train_tokens"] > 1_000_000 and man["num_val_tokens"] > cfg.seq_len
    assert data.tokenizer.vocab_size == cfg.tokenizer_vocab_size
    assert all("site-packages" not in f["path"] for f in man["files"])
    b = next(train_iterator(data, cfg))
    assert b["input_ids"].shape == (cfg.batch_size, cfg.seq_len + 1)


def test_a_pipe_or_device_as_a_corpus_file_is_refused(tmp_path):
    """Break test 62: a FIFO named .txt blocked the run forever (no output); a link to /dev/zero never ends."""
    import os

    fifo = tmp_path / "stream.txt"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    for src in (fifo, zero):
        with pytest.raises(ConfigError, match=rf"^corpus file {src} is not a regular file \(a pipe, device or "
                                              r"socket\); give a file of text, or copy the stream into one$"):
            read_corpus(_cfg(tmp_path, [src]))
