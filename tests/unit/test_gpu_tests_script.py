"""Pins that scripts/gpu-tests runs every GPU test: it selects ``-m gpu`` in tests/gpu, and
every test module there is marked gpu as a whole (a module without the mark would be left
out on the GPU machine, where the tests cannot run here to notice)."""

from __future__ import annotations

import importlib
import os
import re

import pytest

from standins.paths import REPO

GPU_DIR = os.path.join(REPO, "tests", "gpu")


def test_the_script_selects_the_gpu_mark_in_tests_gpu():
    """The script's pytest run is ``-m gpu tests/gpu``: the whole directory, by its mark."""
    with open(os.path.join(REPO, "scripts", "gpu-tests")) as f:
        script = f.read()
    assert re.search(r"pytest -m gpu tests/gpu\b", script), "scripts/gpu-tests runs no -m gpu"


@pytest.mark.parametrize(
    "module", sorted(n[:-3] for n in os.listdir(GPU_DIR) if re.fullmatch(r"test_\w+\.py", n))
)
def test_every_gpu_test_module_is_marked_gpu(module):
    """Each tests/gpu/test_*.py carries ``pytestmark = pytest.mark.gpu`` (the tenant
    commands module among them)."""
    loaded = importlib.import_module(f"tests.gpu.{module}")
    marks = loaded.pytestmark if isinstance(loaded.pytestmark, list) else [loaded.pytestmark]
    assert any(mark.name == "gpu" for mark in marks), module
