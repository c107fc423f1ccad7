"""A console transcript in a Markdown page, read as the commands to run and what they print.

The README's quick start is written as terminal sessions, one fenced ``console`` block
per terminal, in the order a reader opens them:

- a line ``$ <command>`` is a command, typed as it stands (bash runs it);
- the lines after it, up to the next command, are what it prints (stdout and stderr, as
  a terminal shows both);
- a line ``^C`` is the reader pressing Ctrl-C: the command runs until then, and the
  lines after ``^C`` are what it prints on its way out. A reader presses it once the
  terminals opened after this one are done, the latest first;
- ``…`` stands for what the page leaves out: a line that is only ``…`` for any number
  of lines (none included), ``…`` inside a line for any text there.

Output is compared after ``normalize``: what differs from run to run on any machine
(log timestamps, allocation ids, process ids, ages and uptimes) is replaced by a
placeholder, on both sides. Everything else must be as the page shows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

ELLIPSIS = "…"
INTERRUPT = "^C"
PROMPT = "$ "

_FENCE = re.compile(r"^```console\n(.*?)^```$", re.M | re.S)
_VARYING = (
    (re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\b"), "<time>"),  # log timestamps
    (re.compile(r"\bga-[0-9a-f]{16}\b"), "ga-<id>"),  # allocation ids
    (re.compile(r"\bpid \d+\b"), "pid <n>"),  # process ids
    (re.compile(r"\b\d+(?:\.\d+)?[smhd]\b"), "<age>"),  # ages and uptimes: 8s, 5m, 2h, 3d
)


@dataclass
class Command:
    """One ``$`` line of a terminal and what it prints; ``after_interrupt`` is None for a
    command that ends by itself, else what it prints once Ctrl-C was pressed."""

    text: str
    output: list[str] = field(default_factory=list)
    after_interrupt: list[str] | None = None

    @property
    def interrupted(self) -> bool:
        return self.after_interrupt is not None

    @property
    def whole_output(self) -> list[str]:
        return self.output + (self.after_interrupt or [])


def section(markdown: str, heading: str) -> str:
    """The text under ``## <heading>`` up to the next heading of that level or above."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", markdown, re.M | re.S)
    if match is None:
        raise ValueError(f"no section '## {heading}'")
    return match.group(1)


def terminals(markdown: str) -> list[list[Command]]:
    """Every ``console`` block of ``markdown``, in order, as its list of commands."""
    found = []
    for block in _FENCE.findall(markdown):
        commands: list[Command] = []
        for line in block.splitlines():
            if line.startswith(PROMPT):
                commands.append(Command(line[len(PROMPT) :]))
            elif not commands:
                raise ValueError(f"output before the first command of a block: {line!r}")
            elif line == INTERRUPT:
                if commands[-1].interrupted:
                    raise ValueError(f"two ^C for one command: {commands[-1].text!r}")
                commands[-1].after_interrupt = []
            elif commands[-1].after_interrupt is not None:
                commands[-1].after_interrupt.append(line)
            else:
                commands[-1].output.append(line)
        found.append(commands)
    return found


def normalize(line: str) -> str:
    """A line with what varies from run to run replaced by placeholders, trailing blanks
    dropped."""
    for pattern, placeholder in _VARYING:
        line = pattern.sub(placeholder, line)
    return line.rstrip()


def _line_pattern(expected: str) -> re.Pattern:
    parts = [re.escape(part) for part in normalize(expected).split(ELLIPSIS)]
    return re.compile(".*".join(parts), re.S)


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines are what ``expected`` shows, ``…`` standing in as above."""
    wanted = [None if line.strip() == ELLIPSIS else _line_pattern(line) for line in expected]
    seen = [normalize(line) for line in actual]

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(wanted):
            return j == len(seen)
        pattern = wanted[i]
        if pattern is None:  # any lines, none included
            return match(i + 1, j) or (j < len(seen) and match(i, j + 1))
        return j < len(seen) and pattern.fullmatch(seen[j]) is not None and match(i + 1, j + 1)

    return match(0, 0)


def difference(expected: list[str], actual: list[str]) -> str:
    """Both sides, normalized, for a failure message."""
    shown = "\n".join(f"  | {line}" for line in expected)
    printed = "\n".join(f"  | {normalize(line)}" for line in actual)
    return f"the page shows:\n{shown}\nthe command printed (normalized):\n{printed}"
