"""The runtime configurations shipped in hooks/: valid JSON of the right shape,
and the CRI-O/podman hooks.d files run exactly what the containerd snippet
runs (the runc tests run the containerd snippet itself, see runc_env.py)."""

import glob
import json
import os

from tests.harness.runc_env import SHIPPED_HOOKS, SHIPPED_PATH, SHIPPED_SOCKET

HOOKS_D = os.path.join(os.path.dirname(SHIPPED_HOOKS), "..", "oci-hooks.d")


def load(path):
    with open(path) as f:
        return json.load(f)


def test_containerd_snippet_runs_the_hook_at_create_and_poststop():
    hooks = load(SHIPPED_HOOKS)["hooks"]
    assert set(hooks) == {"createRuntime", "poststop"}
    for stage, [hook] in hooks.items():
        assert hook["path"] == SHIPPED_PATH
        assert hook["args"] == ["gpushare-hook", "--socket", SHIPPED_SOCKET, stage]
        assert 0 < hook["timeout"] <= 10  # the hook itself gives up after 2 s


def test_hooks_d_files_match_the_containerd_snippet():
    snippet = load(SHIPPED_HOOKS)["hooks"]
    files = sorted(glob.glob(os.path.join(HOOKS_D, "*.json")))
    assert len(files) == 2
    stages = {}
    for path in files:
        config = load(path)
        assert config["version"] == "1.0.0"
        assert config["when"] == {"always": True}
        [stage] = config["stages"]
        stages[stage] = config["hook"]
    assert stages == {stage: hook for stage, [hook] in snippet.items()}
