"""Pins nodemgr.dra.cdifiles: a claim's CDI spec is written whole or not at all (mode
0600, in a directory made when it is missing, even after it was removed), a write that
fails leaves no file behind, and specs are found and removed by claim UID."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from nodemgr.domain import cdi
from nodemgr.domain.model import Mount
from nodemgr.dra.cdifiles import CdiDirectory

DRIVER = "gpushare.aliyun.com"
CLAIM = "11111111-0000-4000-8000-000000000001"
OTHER = "22222222-0000-4000-8000-000000000002"


def spec(claim_uid: str = CLAIM) -> dict:
    device = cdi.ClaimDevice(
        "gpu-0", None, {"GPUSHARE_ALLOCATION_ID": "a1"}, (Mount("/c", "/h", True),)
    )
    return cdi.claim_spec(DRIVER, claim_uid, [device])


def test_a_spec_is_written_whole_and_private_in_a_directory_made_for_it(tmp_path):
    """The directory does not exist yet: it is made; the file is the spec's JSON, mode
    0600, and no temporary file is left next to it."""
    directory = CdiDirectory(str(tmp_path / "cdi"), DRIVER)
    path = directory.write(CLAIM, spec())
    assert path == directory.file(CLAIM)
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == spec()
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert os.listdir(directory.path) == [os.path.basename(path)]


def test_a_directory_removed_meanwhile_is_made_again(tmp_path):
    """Someone removed the directory (a tmpfs emptied, an operator's rm -r): the next
    spec is written all the same."""
    directory = CdiDirectory(str(tmp_path / "cdi"), DRIVER)
    directory.write(CLAIM, spec())
    shutil.rmtree(directory.path)
    directory.write(OTHER, spec(OTHER))
    assert directory.read(OTHER) == spec(OTHER) and directory.claim_uids() == [OTHER]


def test_a_write_that_fails_leaves_nothing_behind(tmp_path):
    """The spec cannot take its place (a directory holds its name): OSError, and the
    temporary file is gone."""
    directory = CdiDirectory(str(tmp_path / "cdi"), DRIVER)
    os.makedirs(os.path.join(directory.file(CLAIM), "x"))
    with pytest.raises(IsADirectoryError):
        directory.write(CLAIM, spec())
    assert os.listdir(directory.path) == [os.path.basename(directory.file(CLAIM))]


def test_a_spec_written_again_replaces_the_old_one(tmp_path):
    """Prepare again (or restore at start): the file holds the newer spec, whole."""
    directory = CdiDirectory(str(tmp_path / "cdi"), DRIVER)
    directory.write(CLAIM, spec(OTHER))
    directory.write(CLAIM, spec())
    assert directory.read(CLAIM) == spec()


def test_specs_are_listed_and_removed_by_claim_uid(tmp_path):
    """Only this driver's files count; a stale one goes, a live one and another driver's
    stay."""
    directory = CdiDirectory(str(tmp_path / "cdi"), DRIVER)
    directory.write(CLAIM, spec())
    directory.write(OTHER, spec(OTHER))
    foreign = os.path.join(directory.path, "other.example.com-gpu_x.json")
    with open(foreign, "w") as f:
        f.write("{}")
    assert directory.claim_uids() == [CLAIM, OTHER]
    assert directory.remove_stale({CLAIM}) == [OTHER]
    assert directory.claim_uids() == [CLAIM] and os.path.exists(foreign)
    assert directory.remove(CLAIM) and not directory.remove(CLAIM)
