"""``gpushare-node``: the daemon's command line, logging and signals.

Exit codes: 0 stopped by signal; 1 cannot start (no GPUs/NVML, ledger); 2 bad
configuration (one line on stderr naming the key), or an open-file limit too small
for the listeners and the enforcement reserve (one line saying how much is needed).
"""

from __future__ import annotations

import os

# gRPC's C core logs connection chatter (GOAWAY on every kubelet restart) to stderr; it
# reads this once, when grpc is first imported, so it is set before the imports below.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import logging
import signal
import sys
import threading

from nodemgr.common import logline
from nodemgr.common.version import package_version
from nodemgr.config.loading import config_error_line, load_settings
from nodemgr.errors import ConfigError, GpushareError
from nodemgr.runtime import fdlimit
from nodemgr.runtime.wiring import listener_caps, run

log = logging.getLogger("gpushare-node")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpushare-node", description="GPU sharing node daemon: kubelet device plugin"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the YAML configuration (every key optional; default: the built-in defaults; "
        "nodemgr install writes /etc/gpushare/config.yaml)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    logline.configure(args.log_level)
    try:
        fdlimit.prepare(listener_caps(settings))
    except fdlimit.FdLimitError as e:
        print(f"gpushare-node: cannot start: {e}", file=sys.stderr)
        return 2
    stop, reload_requested = threading.Event(), threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload_requested.set())
    log.info(
        "starting gpushare-node %s on node %s (GPU backend %s)",
        version(),
        settings.node_name,
        settings.gpus.backend,
    )
    try:
        run(settings, stop, reload_requested, args.config, version=version())
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        return 2
    except GpushareError as e:
        log.error("cannot run: %s", e)
        return 1
    return 0


def version() -> str:
    return package_version()


def entry() -> None:
    """``main``, then exit at once: when it returns everything is stopped and closed, and
    Python's own finalisation (gRPC's core, module teardown) takes a quarter second or
    more on a busy node, while a daemon asked to stop must be gone within a second."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
