"""Values that come from containers, made safe to log, show or put in an Event (pure; standard
library only, so the runtime hook and the daemon use the same function).

A container's author chooses its env, annotations, mount paths, cgroup names, argv and comm,
and a pod's owner its pod's names. Written out as they are, a newline in one starts a line of
the daemon's log that looks like the daemon's own (``...\\n2026-11-27 10:00:00 CRITICAL ...``);
a terminal escape, a carriage return or a bidirectional override rewrites what an operator
sees. ``quote`` leaves a value that prints as one plain line as it is (a pod name, a card
UUID, a path) and writes any other as a Python string literal: quoted, with ``\\n``,
``\\x1b``, ``\\u2028`` and the like escaped, so it can neither end a line nor hide a
character. Either way it is cut at ``limit`` characters, saying how many were left out.
``one_line`` escapes what does not print in a whole message, without quoting it: the last
guard of every line the daemon logs and the hook writes.
"""

LIMIT = 256  # characters of one value shown; an env value may be a megabyte long


def one_line(text: str) -> str:
    """``text`` with every character that does not print (line breaks, carriage returns,
    terminal escapes, bidirectional overrides) written as its escape, without quotes: a
    whole message made one line, whatever a value in it held."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def quote(value: object, limit: int = LIMIT) -> str:
    """``value`` as one safe line: as it is when every character prints and it has no
    leading or trailing space, else as a Python string literal; cut at ``limit``."""
    text = value if isinstance(value, str) else str(value)
    rest = ""
    if len(text) > limit:
        rest = f"…(+{len(text) - limit} characters)"
        text = text[:limit]
    if text and text.isprintable() and text.strip() == text:
        return text + rest
    return repr(text) + rest
