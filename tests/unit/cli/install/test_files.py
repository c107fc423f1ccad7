"""Pins install's file handling under a root: node paths are taken under the root, relative
node paths are refused, writes are atomic with the given mode and leave no temporary file,
and a manifest that is not install's record stops install with what to do."""

from __future__ import annotations

import json
import os
import stat

import pytest

from nodemgr.cli.install import files
from nodemgr.cli.install.render import InstallError


def test_node_paths_are_under_the_root_and_must_be_absolute():
    """A node path is joined under the root; a relative one is refused naming the option."""
    assert files.under("/tmp/r", "/etc/gpushare/config.yaml") == "/tmp/r/etc/gpushare/config.yaml"
    with pytest.raises(InstallError, match="--config etc/x.yaml: must be an absolute path"):
        files.check_absolute("etc/x.yaml", "--config")


def test_write_atomic_sets_the_mode_and_leaves_no_temporary_file(tmp_path):
    """write_atomic replaces the file with the new content and mode and leaves nothing else."""
    path = tmp_path / "make-base-spec"
    path.write_text("old\n")
    files.write_atomic(str(path), "new\n", 0o755)
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    assert os.listdir(tmp_path) == ["make-base-spec"]


def test_manifest_round_trip_and_foreign_manifest(tmp_path):
    """No manifest reads as {}; a written one reads back; one that is not a record is refused."""
    root = str(tmp_path)
    assert files.read_manifest(root) == {}
    manifest = tmp_path / files.MANIFEST_PATH.lstrip("/")
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"files": {"/etc/x": "abc"}}))
    assert files.read_manifest(root) == {"files": {"/etc/x": "abc"}}
    manifest.write_text(json.dumps(["not", "a", "record"]))
    with pytest.raises(InstallError, match="not a record written by nodemgr install"):
        files.read_manifest(root)
