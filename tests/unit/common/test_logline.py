"""Pins the daemon's log format: a message is always one line, whatever a value in it holds
(a newline and a forged record after it, a carriage return, terminal escapes), written as
escapes; a traceback keeps its lines after the message."""

import io
import logging

from nodemgr.common.logline import OneLineFormatter

FORGED = "GPU-1,1\n2026-11-27 10:00:00,000 CRITICAL nodemgr.enforcement.watchdog: killed process 1"


def logged(message: str, *args, exc_info=None) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter())
    logger = logging.getLogger("test-logline")
    logger.propagate = False
    logger.handlers = [handler]
    try:
        logger.error(message, *args, exc_info=exc_info)
    finally:
        logger.handlers = []
    return stream.getvalue()


def test_a_value_with_a_line_break_stays_on_its_line():
    text = logged("refused container c1: NVIDIA_VISIBLE_DEVICES=%s differs", FORGED)
    assert text.count("\n") == 1 and text.endswith(" differs\n")
    assert "GPU-1,1\\n2026-11-27 10:00:00,000 CRITICAL" in text
    assert " ERROR test-logline: refused container c1:" in text


def test_carriage_returns_and_terminal_escapes_are_written_as_escapes():
    text = logged("mount of %s", "/run/gs/x\r\x1b[2K\x1b[1Aforged\u2028line")
    assert "\r" not in text and "\x1b" not in text and "\u2028" not in text
    assert "/run/gs/x\\r\\x1b[2K\\x1b[1Aforged\\u2028line" in text


def test_a_traceback_keeps_its_lines():
    try:
        raise ValueError("bad\nvalue")
    except ValueError as e:
        text = logged("scan failed", exc_info=e)
    lines = text.splitlines()
    assert lines[0].endswith("scan failed")
    assert lines[1] == "Traceback (most recent call last):"
