"""Code point ranges as UTF-8 byte ranges, for the byte DFA of :mod:`specdec.structured.regex`
(after RE2's construction: a range splits where its encodings change length or leading bytes)."""

from __future__ import annotations


def utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points ``lo..hi`` (surrogates excluded) as sequences of byte ranges: a string
    of bytes is one of these code points' UTF-8 encodings iff it matches one sequence."""
    out: list[list[tuple[int, int]]] = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        if lo <= 0xDFFF and hi >= 0xD800:  # surrogates have no UTF-8 encoding
            stack += [(lo, 0xD7FF), (0xE000, hi)]
            continue
        split = next((b for b in (0x7F, 0x7FF, 0xFFFF) if lo <= b < hi), None)
        if split is not None:  # one encoded length per range
            stack += [(lo, split), (split + 1, hi)]
            continue
        if hi <= 0x7F:
            out.append([(lo, hi)])
            continue
        for i in (1, 2, 3):  # split until only the leading bytes differ in full spans
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack += [(lo, lo | m), ((lo | m) + 1, hi)]
                    break
                if hi & m != m:
                    stack += [(lo, (hi & ~m) - 1), (hi & ~m, hi)]
                    break
        else:
            a, b = chr(lo).encode(), chr(hi).encode()
            out.append(list(zip(a, b)))
    return out
