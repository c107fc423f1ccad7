"""Host paths for the runtime hook, without ``os`` (the builtin ``posix`` module only).

The hook starts at every container creation on the node, and its start-up is most of
its cost. ``import os`` (and ``posixpath``, which imports it) takes about 0.8 ms of
that here, as much as the rest of the hook's own modules together; ``posix`` is
built into the interpreter and already loaded. These are the few ``posixpath``
functions the hook needs, giving the same answers for ``str`` paths:
tests/unit/hooks/test_hostpath.py holds each to ``posixpath`` on random paths and on
random trees of symlinks (loops, dangling links, ``..`` through links).

What it must not do: import anything but ``posix``; guess where ``posixpath`` would
fail (a path it cannot read stays as it is, as ``realpath`` leaves it).
"""

import posix

_SEP = "/"
_FILE_TYPE = 0o170000  # stat's S_IFMT
_SYMLINK = 0o120000
_REGULAR = 0o100000
_CHAR_DEVICE = 0o020000


def is_regular(mode: int) -> bool:
    return mode & _FILE_TYPE == _REGULAR


def is_char_device(mode: int) -> bool:
    return mode & _FILE_TYPE == _CHAR_DEVICE


def isabs(path: str) -> bool:
    return path.startswith(_SEP)


def join(first: str, *rest: str) -> str:
    """posixpath.join: an absolute part starts over; one separator between parts."""
    path = first
    for part in rest:
        if part.startswith(_SEP):
            path = part
        elif not path or path.endswith(_SEP):
            path += part
        else:
            path += _SEP + part
    return path


def split(path: str) -> tuple[str, str]:
    """posixpath.split: (everything before the last separator, the last component); the
    head keeps its separators only when it is nothing but separators."""
    cut = path.rfind(_SEP) + 1
    head, tail = path[:cut], path[cut:]
    if head and head != _SEP * len(head):
        head = head.rstrip(_SEP)
    return head, tail


def dirname(path: str) -> str:
    return split(path)[0]


def normpath(path: str) -> str:
    """posixpath.normpath: no ``.``, no empty components, ``..`` taken back where it can
    be; exactly two leading separators stay two (POSIX leaves their meaning open)."""
    if not path:
        return "."
    leading = 0
    if path.startswith(_SEP):
        leading = 2 if path.startswith(_SEP * 2) and not path.startswith(_SEP * 3) else 1
    kept: list[str] = []
    for part in path.split(_SEP):
        if part in ("", "."):
            continue
        if part == ".." and kept and kept[-1] != "..":
            kept.pop()
        elif part == ".." and leading:
            continue  # above the root is the root
        else:
            kept.append(part)
    return (_SEP * leading + _SEP.join(kept)) or "."


def realpath(path: str) -> str:
    """posixpath.realpath (not strict): every symlink on the way followed, relative to the
    working directory, normalised; a component that cannot be read is taken as it is,
    and a symlink loop is left where it closes."""
    resolved, _ = _follow("", path, {})
    if not isabs(resolved):
        resolved = join(posix.getcwd(), resolved)
    return normpath(resolved)


def _follow(done: str, rest: str, links: dict) -> tuple[str, bool]:
    """``done`` (already real) joined with ``rest``, each symlink in ``rest`` followed;
    False when a loop stopped it. ``links``: symlink path -> its real path, or None while
    it is being followed (meeting it then is a loop)."""
    if isabs(rest):
        rest, done = rest[1:], _SEP
    while rest:
        name, _, rest = rest.partition(_SEP)
        if name in ("", "."):
            continue
        if name == "..":
            if not done:
                done = ".."
            else:
                done, last = split(done)
                if last == "..":
                    done = join(done, "..", "..")
            continue
        candidate = join(done, name)
        try:
            is_link = posix.lstat(candidate).st_mode & _FILE_TYPE == _SYMLINK
        except OSError:
            is_link = False
        if not is_link:
            done = candidate
            continue
        if candidate in links:
            known = links[candidate]
            if known is None:  # a loop
                return join(candidate, rest), False
            done = known
            continue
        links[candidate] = None
        done, whole = _follow(done, posix.readlink(candidate), links)
        if not whole:
            return join(done, rest), False
        links[candidate] = done
    return done, True
