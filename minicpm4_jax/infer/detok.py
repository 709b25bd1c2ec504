"""Incremental detokenization: the text of generated ids, one id at a time, at a bounded cost per id.

Decoding the whole output at every new token (for a stop string or a stream) costs O(output) per token:
about 15 ms a token at a 32K-token output with the MiniCPM4 tokenizer. :class:`IncrementalText` decodes a
window of the last ids instead, the way :func:`minicpm4_jax.generate.continuation_decoder` reads new ids after a
prompt.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# a UTF-8 character has at most 3 continuation bytes (0x80-0xBF) after its first byte
_MAX_CONTINUATION = 3


def byte_value(tokenizer: Any, tok: int) -> int | None:
    """The byte of a byte-fallback piece ``<0xNN>`` (by ``tokenizer.id_to_token``); ``None`` for any other token or a
    tokenizer without ``id_to_token``."""
    piece = getattr(tokenizer, "id_to_token", None)
    p = piece(int(tok)) if piece is not None else None
    if isinstance(p, str) and len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
        try:
            return int(p[3:5], 16)
        except ValueError:
            return None
    return None


def char_start(ids: Sequence[int], start: int, byte_of: Callable[[int], int | None] | None) -> int:
    """``start`` moved back to the first byte of the character ``ids[start]`` belongs to: past at most 3 byte-fallback
    continuation bytes (``byte_of(id)`` in 0x80-0xBF). Unchanged without ``byte_of`` or at 0 / ``len(ids)``."""
    if byte_of is None:
        return start
    for _ in range(_MAX_CONTINUATION):
        b = byte_of(ids[start]) if 0 < start < len(ids) else None
        if b is None or not 0x80 <= b <= 0xBF:
            break
        start -= 1
    return start


def _byte_reader(decode: Any) -> Callable[[int], int | None] | None:
    """``decode``'s ``byte_value`` attribute, or that of the tokenizer ``decode`` is a bound method of, or ``None``."""
    own = getattr(decode, "byte_value", None)
    if own is not None:
        return own
    tokenizer = getattr(decode, "__self__", None)
    if getattr(tokenizer, "id_to_token", None) is None:
        return None
    return lambda tok: byte_value(tokenizer, tok)


class IncrementalText:
    """The text ``decode(ids)`` of ids pushed one at a time, decoding a bounded window per id.

    ``decode``: ids -> text (a tokenizer's decode, or a :func:`~minicpm4_jax.generate.continuation_decoder`).
    ``byte_value``: id -> its byte for a byte-fallback piece ``<0xNN>``, else ``None`` (default: the ``byte_value``
    attribute of ``decode``, or :func:`byte_value` of the tokenizer whose bound ``decode`` method it is). ``tail``: ids
    of context kept before the new ones (16 to 32 are decoded with them).

    The text is kept as committed pieces plus a pending part (the text of the ids after the last commit). A push
    decodes ``ids[w:]`` (``w``: ``tail`` to ``2 * tail`` ids before the commit point, at a character's first byte)
    and takes what follows ``decode(ids[w:k])``. The pending part is committed once it is final: its last id is not
    a byte-fallback piece (a Hugging Face ``ByteFallback`` decoder decodes a run as a whole: one invalid byte makes
    every byte of the run U+FFFD) and its text does not end in U+FFFD (an incomplete character). So the text equals
    the whole decode wherever the decoder is local past a few tokens of context (SentencePiece, ``tokenizer.json``
    with ``add_dummy_prefix``, byte-level BPE). Where the window's decode does not continue the committed text (a
    decoder that rewrites earlier text), the whole ids are decoded again (O(output) that once).

    Cost per id: one decode of at most ``2 * tail + 3`` ids plus the pending ids (a run of byte-fallback pieces
    stays pending until it ends, so an output that is one long byte run still decodes the run at every id).
    """

    def __init__(self, decode: Callable[[list[int]], str], byte_value: Callable[[int], int | None] | None = None,
                 tail: int = 16):
        self._decode = decode
        self._byte_value = _byte_reader(decode) if byte_value is None else byte_value
        self._tail = max(int(tail), 1)
        self.ids: list[int] = []
        self._pieces: list[str] = []  # the committed text, in pieces
        self._committed = 0  # its length
        self._k = 0  # ids[:k] are committed
        self._w = 0  # the window's start
        self._base = ""  # decode(ids[w:k])
        self._pending = ""  # the text of ids[k:]

    def __len__(self) -> int:
        return self._committed + len(self._pending)

    def push(self, tok: int) -> int:
        """Append ``tok``; return the first index of the text this changed (the text before it is as it was)."""
        since = self._committed
        self.ids.append(int(tok))
        window = self._decode(self.ids[self._w:])
        if window.startswith(self._base):
            self._pending = window[len(self._base):]
        else:
            since = self._resync()
        last_byte = self._byte_value is not None and self._byte_value(self.ids[-1]) is not None
        if not last_byte and not self._pending.endswith("\ufffd"):
            self._commit()
        return since

    def text_from(self, start: int) -> str:
        """``text[start:]`` (cost: its length plus the pieces it spans)."""
        need = len(self) - max(int(start), 0)
        if need <= 0:
            return ""
        if need <= len(self._pending):
            return self._pending[len(self._pending) - need:]
        out, have, i = [self._pending], len(self._pending), len(self._pieces) - 1
        while have < need and i >= 0:
            out.append(self._pieces[i])
            have += len(self._pieces[i])
            i -= 1
        return "".join(reversed(out))[have - need:]

    def text(self) -> str:
        """The whole text (O(length))."""
        return "".join(self._pieces) + self._pending

    def _commit(self) -> None:
        self._pieces.append(self._pending)
        self._committed += len(self._pending)
        self._base += self._pending  # decode(ids[w:k]) for the new k: the window just decoded
        self._pending = ""
        self._k = len(self.ids)
        if self._k - self._w > 2 * self._tail:  # move the window up (one decode every ``tail`` ids or so)
            self._move_window()

    def _move_window(self) -> None:
        """Start the window ``tail`` ids before the commit point, at the first of up to ``_MAX_CONTINUATION + 1``
        starts (going back one id at a time) whose decode ends the committed text. A start inside a character or a
        byte-fallback run decodes otherwise (U+FFFD; a ``ByteFallback`` decoder turns the whole cut run into U+FFFD),
        which only ``byte_value`` could tell beforehand; an empty decode (a lone space a ``Strip`` decoder removes)
        ends every text but cannot show a later change of it. Without such a start the window stays where it was."""
        start = char_start(self.ids, self._k - self._tail, self._byte_value)
        for w in range(start, max(start - _MAX_CONTINUATION - 1, self._w), -1):
            base = self._decode(self.ids[w:self._k])
            if base and len(base) <= self._committed and self.text_from(self._committed - len(base)) == base:
                self._w, self._base = w, base
                return

    def _resync(self) -> int:
        """Decode all ids again (the window's decode did not continue the committed text); the first changed index."""
        old, full = self.text(), self._decode(self.ids)
        same = next((i for i, (a, b) in enumerate(zip(old, full)) if a != b), min(len(old), len(full)))
        self._pieces, self._committed, self._k, self._w, self._base, self._pending = [], 0, 0, 0, "", full
        return same
