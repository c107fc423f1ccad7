"""Every line the daemon and the scheduler extender log is one line of their own.

Messages carry values tenants choose; they are quoted where the message is made
(:func:`hooks.textsafe.quote`). This formatter is the last guard: whatever in a message
does not print is written as its escape, so no value can start a line that looks like
the daemon's own. A traceback, appended after the message, keeps its lines.
"""

from __future__ import annotations

import logging

from hooks.textsafe import one_line

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = one_line(record.message)
        return super().formatMessage(record)


def configure(level: str | int) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter())
    logging.basicConfig(level=level, handlers=[handler])
