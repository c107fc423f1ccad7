"""Pins how a console transcript in a Markdown page is read (standins.transcript):
blocks are terminals, ``$`` lines commands, ``^C`` splits a command's output, ``…``
stands for lines or text left out, and what varies between runs compares equal."""

import pytest

from standins import transcript

PAGE = """# x

## Quick start

Text.

```console
$ scripts/quickstart
config: …/.quickstart/config.yaml
…
^C
2026-11-26 23:51:15,772 INFO gpushare-node: stopped
$ scripts/quickstart-clean
removed …/.quickstart
```

```console
$ nodemgr allocations
ga-0cb1833621d71a35  4096M  8s
```

```sh
not a console block
```

## Next
```console
$ elsewhere
```
"""


def test_blocks_are_terminals_of_commands_with_their_output():
    """Each console block of the section is a terminal; ``$`` starts a command; ``^C``
    splits what it prints before and after Ctrl-C; other fences and sections are not read."""
    blocks = transcript.terminals(transcript.section(PAGE, "Quick start"))
    assert [[c.text for c in block] for block in blocks] == [
        ["scripts/quickstart", "scripts/quickstart-clean"],
        ["nodemgr allocations"],
    ]
    first = blocks[0][0]
    assert first.interrupted and first.output == ["config: …/.quickstart/config.yaml", "…"]
    assert first.after_interrupt == ["2026-11-26 23:51:15,772 INFO gpushare-node: stopped"]
    assert not blocks[0][1].interrupted and blocks[0][1].whole_output == ["removed …/.quickstart"]


def test_a_transcript_that_cannot_be_read_is_an_error():
    """Output before any command, two ^C for one command, or no such section."""
    with pytest.raises(ValueError, match="before the first command"):
        transcript.terminals("```console\noutput\n$ cmd\n```\n")
    with pytest.raises(ValueError, match="two"):
        transcript.terminals("```console\n$ cmd\n^C\n^C\n```\n")
    with pytest.raises(ValueError, match="no section"):
        transcript.section(PAGE, "Install")


def test_what_varies_between_runs_compares_equal():
    """Log times, allocation ids, process ids and ages are placeholders on both sides."""
    shown = [
        "2026-11-26 23:51:15,772 INFO x: pid 27360, up 17s",
        "ga-0cb1833621d71a35  4096M  8s",
    ]
    printed = [
        "2027-01-02 03:04:05,006 INFO x: pid 4, up 2m",
        "ga-ffffffffffffffff  4096M  12s   ",
    ]
    assert transcript.matches(shown, printed)
    assert not transcript.matches(shown, ["2027-01-02 03:04:05,006 INFO x: pid 4, up 2m"])
    assert not transcript.matches(["4096M"], ["4097M"])


def test_an_ellipsis_stands_for_lines_or_text_left_out():
    """``…`` alone: any number of lines, none included; inside a line: any text there.
    Everything else must be as shown, line for line."""
    shown = ["start", "…", "PASS  cgroups  …", "end"]
    assert transcript.matches(shown, ["start", "PASS  cgroups  v2", "end"])
    assert transcript.matches(shown, ["start", "a", "b", "PASS  cgroups  hybrid: v1", "end"])
    assert not transcript.matches(shown, ["start", "FAIL  cgroups  v2", "end"])
    assert not transcript.matches(shown, ["start", "PASS  cgroups  v2", "end", "extra"])
    assert not transcript.matches(shown, ["PASS  cgroups  v2", "end"])
    assert transcript.matches(["a", "…"], ["a", "b", "c"]) and transcript.matches(["a", "…"], ["a"])
