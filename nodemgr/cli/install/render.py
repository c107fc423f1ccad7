"""What ``nodemgr install`` writes: every file rendered from the Jinja2 templates.

The runtimes run the hook through a launcher whose ``#!`` line starts this Python with
``-IS`` (no PYTHON* variables, site-packages or .pth files) and imports the hook from
its package directory: it starts in about a third of the console script's time, at
every container creation. ``exec_arg``, ``env_value`` and ``tmpfiles_path`` escape a
value for a unit's Exec*= or Environment= line and a tmpfiles.d line, so a path with a
space, ``%`` or ``$`` means what it says; a control character is refused.
``shipped_files()`` renders the copies kept in the source tree (``systemd/``,
``hooks/``), so tests can check they never go stale.

What it must not do: write anything, or read the files under the install root
(``apply`` and ``files`` do that).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass

import jinja2
import yaml

from mps.layout import MpsLayout
from nodemgr.config.schema import (
    DraSettings,
    EnforcementSettings,
    GpuSettings,
    KubeletSettings,
    KubernetesSettings,
    MetricsSettings,
    MpsSettings,
    ResourceSettings,
    Settings,
    StatusSettings,
)
from nodemgr.errors import GpushareError

CONFIG_PATH = "/etc/gpushare/config.yaml"
UNIT_DIR = "/etc/systemd/system"
NODE_UNIT = "gpushare-node.service"
MPS_UNIT = "gpushare-mps@.service"
TMPFILES_PATH = "/etc/tmpfiles.d/gpushare.conf"
OCI_HOOKS_DIR = "/etc/containers/oci/hooks.d"
CONTAINERD_DIR = "/etc/gpushare/containerd"
CONTAINERD_BASE_SPEC = "/etc/containerd/gpushare-base-spec.json"
HOOK_LAUNCHER = "/etc/gpushare/gpushare-hook"
HOOK_PYTHON_FLAGS = "-IS"  # -I -S: one #! argument, as the kernel passes one
# The shipped copies' Python and hook package: `pip install .` as root on Debian 12.
SHIPPED_PYTHON = "/usr/bin/python3"
SHIPPED_PACKAGE_DIR = "/usr/local/lib/python3.11/dist-packages"
# Where `pip install` as root puts console scripts: the paths of the shipped copies.
SHIPPED_SCRIPTS_DIR = "/usr/local/bin"
OCI_HOOK_FILES = {
    "50-gpushare-create.json": "createRuntime",
    "50-gpushare-poststop.json": "poststop",
}
_SAFE_UNIT_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:@+=,-"
)


class InstallError(GpushareError):
    """The message says why and what to do."""


@dataclass(frozen=True)
class Target:
    """Where things are on the node (absolute paths)."""

    node_command: str  # the gpushare-node console script
    hook_command: str  # the gpushare-hook console script (for runs by hand)
    config_path: str  # the config file the unit passes with --config
    run_dir: str
    state_dir: str
    hook_socket: str
    control_binary: str  # MPS control binary: a name in $PATH or an absolute path
    hook_python: str = SHIPPED_PYTHON  # the Python the hook launcher starts
    hook_package_dir: str = SHIPPED_PACKAGE_DIR
    hook_guards: tuple[str, ...] = ()

    @property
    def nodemgr_command(self) -> str:
        """Next to gpushare-node: one distribution installs both."""
        return os.path.join(os.path.dirname(self.node_command), "nodemgr")

    @classmethod
    def of(
        cls,
        settings: Settings,
        node_command: str,
        hook_command: str,
        config_path: str,
        hook_python: str = SHIPPED_PYTHON,
        hook_package_dir: str = SHIPPED_PACKAGE_DIR,
    ):
        return cls(
            node_command=node_command,
            hook_command=hook_command,
            config_path=config_path,
            run_dir=settings.run_dir,
            state_dir=settings.state_dir,
            hook_socket=settings.hook_socket,
            control_binary=settings.mps.control_binary,
            hook_python=hook_python,
            hook_package_dir=hook_package_dir,
            hook_guards=settings.hook_guards(),
        )


@dataclass(frozen=True)
class FileSpec:
    path: str
    content: str
    mode: int
    is_config: bool = False  # written only when absent; never replaced or removed

    @property
    def digest(self) -> str:
        return sha256(self.content.encode())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- rendering ------------------------------------------------------------------------


def render(target: Target, *, with_config: bool = True) -> list[FileSpec]:
    for name, values in dataclasses.asdict(target).items():
        value = "".join(values) if isinstance(values, tuple) else values
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise InstallError(
                f"{name} {value!r} contains a control character, which unit files and "
                "hook configs cannot carry: use a path without it"
            )
    env = _environment()
    layout = MpsLayout(target.run_dir.replace("%", "%%"))  # %i below is a unit specifier
    values = {
        **dataclasses.asdict(target),
        "shm_dir": MpsLayout(target.run_dir).shm_dir("<card UUID>"),
        "nodemgr_command": target.nodemgr_command,
        "pipe_dir": layout.pipe_dir("%i"),
        "log_dir": layout.log_dir("%i"),
        "hook_launcher": HOOK_LAUNCHER,
        "hook_options": _hook_options(target),
    }

    def text(template: str, **extra) -> str:
        return env.get_template(template).render(**values, **extra)

    files = []
    if with_config:
        files.append(FileSpec(target.config_path, _default_config(env, target), 0o644, True))
    files += [
        FileSpec(f"{UNIT_DIR}/{NODE_UNIT}", text("gpushare-node.service.j2"), 0o644),
        FileSpec(f"{UNIT_DIR}/{MPS_UNIT}", text("gpushare-mps@.service.j2"), 0o644),
        FileSpec(TMPFILES_PATH, text("tmpfiles.conf.j2"), 0o644),
        FileSpec(HOOK_LAUNCHER, hook_launcher(target.hook_python, target.hook_package_dir), 0o755),
    ]
    for name, stage in OCI_HOOK_FILES.items():
        files.append(
            FileSpec(f"{OCI_HOOKS_DIR}/{name}", text("oci-hook.json.j2", stage=stage), 0o644)
        )
    files += [
        FileSpec(f"{CONTAINERD_DIR}/gpushare-hooks.json", text("containerd-hooks.json.j2"), 0o644),
        FileSpec(f"{CONTAINERD_DIR}/make-base-spec", text("make-base-spec.j2"), 0o755),
    ]
    return files


def _hook_options(target: Target) -> list[str]:
    """``--run-dir`` only where the socket's directory is not it (the hook assumes it is)."""
    options = ["--socket", target.hook_socket]
    if os.path.normpath(os.path.dirname(target.hook_socket)) != os.path.normpath(target.run_dir):
        options += ["--run-dir", target.run_dir]
    for path in target.hook_guards:
        options += ["--guard", path]
    return options


def hook_launcher(python: str, package_dir: str) -> str:
    """InstallError when ``python`` cannot stand in a ``#!`` line."""
    if not os.path.isabs(python) or any(ch in python for ch in " \t\n") or len(python) > 200:
        raise InstallError(
            f"the Python at {python!r} cannot start the runtime hook from a #! line (it must "
            "be an absolute path of at most 200 characters without spaces): install "
            "gpushare-node into a Python at such a path"
        )
    return (
        _environment()
        .get_template("gpushare-hook.j2")
        .render(python=python, flags=HOOK_PYTHON_FLAGS, package_dir=package_dir)
    )


def _default_config(env: jinja2.Environment, target: Target) -> str:
    return env.get_template("config.yaml.j2").render(
        config_path=target.config_path,
        kubelet=KubeletSettings(),
        state_dir=Settings.state_dir,
        run_dir=Settings.run_dir,
        gpus=GpuSettings(),
        resources=ResourceSettings(),
        mps=MpsSettings(),
        enforcement=EnforcementSettings(),
        status=StatusSettings(),
        metrics=MetricsSettings(),
        kubernetes=KubernetesSettings(),
        dra=DraSettings(),
    )


def shipped_files() -> dict[str, str]:
    """Path relative to the repository -> content."""
    target = Target.of(
        Settings(node_name="unused"),  # the node name is in no rendered file
        f"{SHIPPED_SCRIPTS_DIR}/gpushare-node",
        f"{SHIPPED_SCRIPTS_DIR}/gpushare-hook",
        CONFIG_PATH,
    )
    where = {
        HOOK_LAUNCHER: "hooks/gpushare-hook",
        f"{UNIT_DIR}/{NODE_UNIT}": f"systemd/{NODE_UNIT}",
        f"{UNIT_DIR}/{MPS_UNIT}": f"systemd/{MPS_UNIT}",
        TMPFILES_PATH: "systemd/tmpfiles.d/gpushare.conf",
        **{f"{OCI_HOOKS_DIR}/{name}": f"hooks/oci-hooks.d/{name}" for name in OCI_HOOK_FILES},
        f"{CONTAINERD_DIR}/gpushare-hooks.json": "hooks/containerd/gpushare-hooks.json",
        f"{CONTAINERD_DIR}/make-base-spec": "hooks/containerd/make-base-spec",
    }
    return {where[spec.path]: spec.content for spec in render(target, with_config=False)}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("nodemgr.cli.install", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # unit files, YAML and JSON, not HTML
    )
    env.filters["exec_arg"] = exec_arg
    env.filters["env_value"] = env_value
    env.filters["tmpfiles_path"] = tmpfiles_path
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    env.filters["python"] = repr  # a Python literal
    env.filters["yaml"] = _yaml_scalar
    return env


def exec_arg(value: str, keep_specifiers: bool = False) -> str:
    """One argument of a unit's Exec*= line: quoted when needed, ``%`` and ``$`` escaped
    (``keep_specifiers``: ``%`` is already escaped, or a specifier)."""
    escaped = value.replace("$", "$$")
    if not keep_specifiers:
        escaped = escaped.replace("%", "%%")
    return _quote_if_needed(escaped)


def env_value(assignment: str, keep_specifiers: bool = False) -> str:
    """``$`` is not special in ``Environment=``."""
    return _quote_if_needed(assignment if keep_specifiers else assignment.replace("%", "%%"))


def tmpfiles_path(value: str) -> str:
    return _quote_if_needed(value.replace("%", "%%"))


def _quote_if_needed(text: str) -> str:
    if text and set(text) <= _SAFE_UNIT_CHARS | {"%", "$"}:
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _yaml_scalar(value: object) -> str:
    """``""`` for the empty string, as the comments say."""
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").removesuffix("\n")


# --- the console scripts ----------------------------------------------------------------


def console_scripts() -> tuple[str, str]:
    """Next to this Python, else in $PATH."""
    found = []
    here = os.path.dirname(sys.executable)
    for name in ("gpushare-node", "gpushare-hook"):
        candidate = os.path.join(here, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            found.append(os.path.abspath(candidate))
            continue
        which = shutil.which(name)
        if which is None:
            raise InstallError(
                f"cannot find the {name} console script next to {sys.executable} or in $PATH: "
                "install the package into this Python (pip install .) and run its nodemgr"
            )
        found.append(os.path.abspath(which))
    return found[0], found[1]


def hook_package_dir() -> str:
    import hooks

    return os.path.dirname(os.path.dirname(os.path.abspath(hooks.__file__)))
