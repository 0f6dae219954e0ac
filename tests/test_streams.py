"""The printer `fleet run` streams the ranks' output through: whole lines, never more than its bound held, the
lines it had to drop counted per rank and said once at the end (a terminal slower than the ranks must not make
fleet hold an unbounded backlog; the ranks themselves write files and never wait on it)."""

from __future__ import annotations

import threading

import pytest

from toolkit.errors import UserError
from toolkit.launcher.jobhosts.streams import Printer, RankFilter


def test_a_full_printer_drops_and_counts_instead_of_holding_more(capsys: pytest.CaptureFixture[str]) -> None:
    out = Printer(": ", bound=2)
    out.lines("[rank1]", ["line 0\x1b[2J"])  # the writer is not running yet: a stalled terminal
    out.lines("[rank1]", [f"line {i}\x1b[2J" for i in range(1, 5)])  # one batch: room for one of its lines
    out.lines("[rank0]", ["late"])
    assert out.held == 2 and out.dropped == {"[rank1]": 3, "[rank0]": 1}
    out.start()
    out.close()
    captured = capsys.readouterr()
    assert captured.out == "[rank1]: line 0\\x1b[2J\n[rank1]: line 1\\x1b[2J\n"  # whole lines, escapes shown
    assert "[rank1]: 3 line(s) not shown" in captured.err and "[rank0]: 1 line(s) not shown" in captured.err


def test_lines_from_many_threads_are_never_torn(capsys: pytest.CaptureFixture[str]) -> None:
    out = Printer(": ", bound=100_000)
    out.start()

    def talk(rank: int) -> None:
        for i in range(0, 2000, 10):
            out.lines(f"[rank{rank}]", [f"{rank}" * 50 + f" {j}" for j in range(i, i + 10)])

    threads = [threading.Thread(target=talk, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8000
    for line in lines:
        prefix, _, text = line.partition(": ")
        rank = prefix[len("[rank"):-1]
        assert text.startswith(rank * 50 + " "), line


def test_whose_output_is_shown() -> None:
    assert RankFilter.parse("0,3") == RankFilter(ranks=frozenset({0, 3}))
    assert RankFilter.parse("", "1") == RankFilter(local_ranks=frozenset({1}))
    assert RankFilter.parse(quiet=True).quiet
    for args, said in ((("0,x",), "--ranks '0,x': give ranks as whole numbers"),
                       (("0", "1"), "--ranks and --local-ranks-filter both given"),
                       (("-1",), "--ranks '-1': ranks start at 0")):
        with pytest.raises(UserError, match=said):
            RankFilter.parse(*args)


def test_a_stream_is_cut_into_whole_lines_whatever_its_reads() -> None:
    """The bytes of a stream come in reads of any size: lines (a multi-byte character cut between two reads, a
    byte that is not UTF-8) come out whole, each read's complete lines in one call, the stream's header swallowed,
    a last line without a newline handed out at the end."""
    from toolkit.launcher.remote.host import _STREAM_HEADER, LineSplitter

    wire = f"{_STREAM_HEADER} 41 41\nfirst\nsecond é\n\nbad ".encode() + b"\xff byte\nlast"
    for cut in (1, 2, 3, 7, len(wire)):
        calls: list[list[str]] = []
        lines = LineSplitter(calls.append)
        for at in range(0, len(wire), cut):
            lines.feed(wire[at:at + cut])
        lines.flush()
        assert lines.header == (41, 41)
        assert [line for call in calls for line in call] == ["first", "second é", "", "bad \ufffd byte", "last"], cut
        assert all(calls) and len(calls) <= len(wire) // cut + 1
