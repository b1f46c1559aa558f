"""Text from jobs made safe to show: `printable(text)` is what a terminal prints or a page renders
of anything a job wrote (its stderr in a failure reason, its log lines, a sentence that quotes
them). Every command and the dashboard call it where they print or render; the API's JSON keeps
the text exact.

What goes: every escape sequence a terminal would act on, whole (ECMA-48 and ECMA-35): CSI (`ESC [`
or C1 `\\x9b` … a final byte: cursor moves, clear screen, colours), the control strings OSC, DCS,
SOS, PM and APC (`ESC ]`, `ESC P`, … or their C1 forms, up to BEL, ST or the end of the line: a
window title, an OSC 52 clipboard write, a hyperlink), and the other `ESC` sequences (`ESC c`, a
reset); then every C0 and C1 control left (a bare ESC, a carriage return that would overwrite a
line, a backspace), DEL, the bidirectional overrides and isolates that would show a line in
another order than it is, line and paragraph separators, and lone surrogates (not text, and
unprintable). What stays: every other character, unicode letters and symbols included, and tab;
with `lines=True`, line feeds too (`\\r\\n` read as one).
"""

from __future__ import annotations

import re

# A whole escape sequence, as a terminal reads it (one that a line ends in the middle of, too).
_SEQUENCE = (
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"  # CSI: parameters, intermediates, final
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x9c\x1b\n]*(?:\x07|\x9c|\x1b\\)?"  # OSC, DCS, SOS, PM, APC
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]"  # any other: intermediates, then its final byte
)
# What is left that a line may not hold: C0 but tab (and line feed), DEL, C1, bidirectional
# embeddings, overrides and isolates, line and paragraph separators, lone surrogates.
_OTHER = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff"
_LINE = re.compile(rf"{_SEQUENCE}|[\n{_OTHER}]")
_LINES = re.compile(rf"{_SEQUENCE}|[{_OTHER}]")


def printable(text: str, lines: bool = False) -> str:
    """`text` without what would drive a terminal or disguise itself on a page (the module's
    docstring says what): one line, or with `lines` several (line feeds kept)."""
    if lines:
        return _LINES.sub("", text.replace("\r\n", "\n"))
    return _LINE.sub("", text)
