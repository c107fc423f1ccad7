"""Files under the install root: node paths, atomic writes, and install's manifest.

Node paths (``/etc/...``) are taken ``under`` ``--root``. A crash during
``write_atomic`` leaves the old file or the new one, never half. The manifest records
each written file's SHA-256 (JSON files cannot carry a marker comment), the directories
created and the settings uninstall needs.
"""

from __future__ import annotations

import json
import os
import tempfile

from nodemgr.cli.install.render import InstallError, Target

MANIFEST_PATH = "/etc/gpushare/installed-files.json"


def under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def check_absolute(path: str, what: str) -> None:
    if not os.path.isabs(path):
        raise InstallError(
            f"{what} {path}: must be an absolute path (the path gpushare-node reads on the node)"
        )


def makedirs(root: str, directory: str) -> list[str]:
    """0755; the node paths created."""
    missing = []
    while not os.path.isdir(under(root, directory)):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        os.mkdir(under(root, path), 0o755)
    return missing


def write_atomic(path: str, content: str, mode: int) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_manifest(root: str) -> dict:
    """{} when there is none."""
    path = under(root, MANIFEST_PATH)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise InstallError(
            f"{path}: cannot read nodemgr install's record of its files ({e}); move it away "
            "and run nodemgr install again"
        ) from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InstallError(
            f"{path}: not a record written by nodemgr install; move it away and run "
            "nodemgr install again"
        )
    return manifest


def write_manifest(
    root: str, old: dict, files: dict[str, str], created_dirs: list[str], target: Target
) -> None:
    manifest = {
        "written_by": "nodemgr install; nodemgr uninstall removes these files unless edited",
        "files": {**old.get("files", {}), **files},
        "directories": sorted(set(old.get("directories", [])) | set(created_dirs)),
        "config_path": target.config_path,
        "state_dir": target.state_dir,
        "run_dir": target.run_dir,
        "control_binary": target.control_binary,
    }
    makedirs(root, os.path.dirname(MANIFEST_PATH))
    write_atomic(under(root, MANIFEST_PATH), json.dumps(manifest, indent=2) + "\n", 0o644)
