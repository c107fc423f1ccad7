"""This test process out of file descriptors, for real: what a daemon flooded with
connections lives through (EMFILE on every open, socket, pidfd).

``no_descriptors_left`` lowers the soft RLIMIT_NOFILE to a little above what is open, opens
/dev/null until the kernel says EMFILE, and on leaving closes them and puts the limit back.
Other threads of the process (a gRPC server, a logger) meet the same EMFILE meanwhile:
keep the block short and do nothing in it that must open a file to report a failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def no_descriptors_left(spare: int = 0) -> Iterator[None]:
    """Every descriptor taken (``spare`` left free) until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    try:
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise
                break
        for fd in held[len(held) - spare :] if spare else ():
            os.close(fd)
        del held[len(held) - spare :]
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
