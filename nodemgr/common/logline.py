"""Every line the daemon and the scheduler extender log is one line of their own.

Messages carry values that pods, tenants and their containers choose (env values, pod and
container names, mount paths, cgroup names, answers read from processes). Where a message is
made such values are shown with :func:`hooks.textsafe.quote`; this formatter is the last
guard: whatever a message still holds that does not print (a line break, a carriage return,
a terminal escape) is written as its escape, so no value can start a line that looks like
the daemon's own. A traceback, which the logging module appends after the message, keeps
its lines.
"""

from __future__ import annotations

import logging

from hooks.textsafe import one_line

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineFormatter(logging.Formatter):
    """``FORMAT`` with the message made one line (:func:`hooks.textsafe.one_line`)."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = one_line(record.message)
        return super().formatMessage(record)


def configure(level: str | int) -> None:
    """The root logger at ``level``, writing one-line records to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter())
    logging.basicConfig(level=level, handlers=[handler])
