"""Pins ``gpushare-node``'s command line (nodemgr.runtime.main): --help describes the
options and exits 0; a bad config file, or a config the node cannot serve, exits 2 with
exactly one line on stderr naming the key; a start that fails for another reason (the
ledger) exits 1 with one log line saying why; an open-file limit too small for the
listeners and the enforcement reserve exits 2 before anything starts; an unknown option
or log level is refused by argparse; and ``python -m nodemgr.runtime.main`` runs the same
code as the script."""

import os
import subprocess
import sys
import textwrap

import pytest

from nodemgr.allocation.ledger import LEDGER_FILE
from nodemgr.runtime.main import main
from standins.cards import GPU0
from standins.paths import REPO


def config(tmp_path, memory_mib=15360, unit_mib=1024) -> str:
    path = tmp_path / "gpushare.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            node_name: node-a
            state_dir: {tmp_path}/state
            run_dir: {tmp_path}/run
            kubelet: {{device_plugin_dir: {tmp_path}/dp, pod_resources_socket: {tmp_path}/pr.sock}}
            gpus:
              backend: simulated
              simulated:
                devices: [{{uuid: {GPU0}, name: A100, memory_mib: {memory_mib}}}]
            resources: {{memory_unit_mib: {unit_mib}}}
            kubernetes: {{enabled: false}}
            """
        )
    )
    return str(path)


def run_daemon(args, module=False, timeout=60) -> subprocess.CompletedProcess:
    """The daemon in its own process (main installs signal handlers: not in pytest's)."""
    if module:
        command = [sys.executable, "-m", "nodemgr.runtime.main", *args]
    else:
        command = [
            sys.executable,
            "-c",
            "import sys; from nodemgr.runtime.main import main; sys.exit(main(sys.argv[1:]))",
            *args,
        ]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_an_open_file_limit_too_small_exits_2_before_anything_starts(tmp_path):
    """RLIMIT_NOFILE 200 cannot hold the listeners' caps and the enforcement reserve: exit 2
    with one line on stderr saying how much is needed and how to fix it; nothing was
    started (no run directory, no ledger)."""
    done = subprocess.run(
        ["prlimit", "--nofile=200:200", "--", sys.executable, "-m", "nodemgr.runtime.main",
         "--config", config(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if "cannot start" in x]
    assert line.startswith("gpushare-node: cannot start: the open-file limit (RLIMIT_NOFILE) ")
    assert "is 200, under the" in line and "LimitNOFILE=" in line
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "state")


def test_help_describes_the_options(capsys):
    """--help prints the usage with --config and --log-level and exits 0."""
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gpushare-node")
    assert "--config FILE" in out and "--log-level" in out


@pytest.mark.parametrize("argv", [["--log-level", "CHATTY"], ["--no-such-option"]])
def test_bad_arguments_are_refused(capsys, argv):
    """An unknown option or log level: argparse's usage error, exit 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage: gpushare-node" in capsys.readouterr().err


def test_a_missing_config_file_exits_2_with_one_line(tmp_path, capsys):
    """A config file that cannot be read: exit 2, one stderr line naming the file."""
    missing = str(tmp_path / "nope.yaml")
    assert main(["--config", missing]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"gpushare-node: config error: {missing}: cannot read")


def test_an_invalid_value_exits_2_naming_the_key(tmp_path, capsys):
    """An invalid value: exit 2, one line naming the dotted key."""
    path = tmp_path / "gpushare.yaml"
    path.write_text("resources:\n  placement: everywhere\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("gpushare-node: config error: resources.placement: ")


def test_a_config_the_node_cannot_serve_exits_2_with_one_line(tmp_path):
    """A memory unit too small for the cards is found at start-up: exit 2, with exactly one
    config error line on stderr (beside the start-up log line) and no traceback."""
    done = run_daemon(["--config", config(tmp_path, memory_mib=819200, unit_mib=1)])
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "config error" in line]
    assert len(lines) == 1
    assert lines[0].startswith("gpushare-node: config error: resources.memory_unit_mib: ")
    assert "Traceback" not in done.stderr


def test_a_ledger_that_cannot_be_opened_exits_1(tmp_path):
    """A corrupt ledger: exit 1 with one ERROR line 'cannot run: ...' naming the file."""
    state = tmp_path / "state"
    state.mkdir()
    (state / LEDGER_FILE).write_bytes(b"not a database " * 100)
    done = run_daemon(["--config", config(tmp_path)])
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "cannot run: cannot open the ledger" in errors[0]
    assert str(state / LEDGER_FILE) in errors[0]
    assert "Traceback" not in done.stderr


def test_python_dash_m_runs_like_the_script(tmp_path):
    """``python -m nodemgr.runtime.main`` behaves as the console script: here, the same
    exit 2 with the config error line, not a NameError traceback."""
    done = run_daemon(["--config", config(tmp_path, memory_mib=819200, unit_mib=1)], module=True)
    assert "NameError" not in done.stderr
    assert done.returncode == 2


def test_module_import_sets_grpc_verbosity():
    """Importing the module quiets gRPC's C core (kubelet restarts log GOAWAY otherwise),
    unless the operator set GRPC_VERBOSITY."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    code = "import os, nodemgr.runtime.main; print(os.environ['GRPC_VERBOSITY'])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "ERROR"
    env["GRPC_VERBOSITY"] = "DEBUG"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "DEBUG"
