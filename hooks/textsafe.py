"""Values that come from containers, made safe to log, show or put in an Event (pure;
standard library only, so the runtime hook and the daemon share it).

A container's author chooses its env, annotations, mount paths, cgroup names, argv and
comm, a pod's owner its names. Written out raw, a newline forges a log line of the
daemon's own; a terminal escape, carriage return or bidirectional override rewrites what
an operator sees. ``quote`` leaves a value that prints as one plain line as it is and
writes any other as a Python string literal, cut at ``limit`` characters. ``one_line``
escapes what does not print in a whole message, unquoted: the last guard of every line
the daemon logs and the hook writes.
"""

LIMIT = 256  # characters of one value shown; an env value may be a megabyte long


def one_line(text: str) -> str:
    """``text`` with every character that does not print written as its escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def quote(value: object, limit: int = LIMIT) -> str:
    """``value`` as it is when every character prints and it has no leading or trailing
    space, else as a Python string literal; cut at ``limit``."""
    text = value if isinstance(value, str) else str(value)
    rest = ""
    if len(text) > limit:
        rest = f"…(+{len(text) - limit} characters)"
        text = text[:limit]
    if text and text.isprintable() and text.strip() == text:
        return text + rest
    return repr(text) + rest
