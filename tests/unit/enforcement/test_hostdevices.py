"""Pins what the host says of NVIDIA's device nodes: the majors /proc/devices gives NVIDIA's
drivers besides 195 (read from a file written as the kernel writes it), an unreadable file
raising an error that names it, and the host's node of a name by its type and numbers (none
where nothing is there; no device node for a plain file)."""

import os

import pytest

from nodemgr.domain.speccheck import HostNode
from nodemgr.enforcement import hostdevices

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
 10 misc
195 nvidia-frontend
234 nvidia-caps
236 nvidia-caps-imex-channels
510 nvidia-uvm
511 nvidia-nvswitch

Block devices:
  8 sd
259 blkext
"""


def test_nvidia_majors_are_read_from_proc_devices(tmp_path):
    path = tmp_path / "devices"
    path.write_text(PROC_DEVICES)
    assert hostdevices.nvidia_majors(str(path)) == {234, 236, 510, 511}


def test_an_unreadable_proc_devices_is_an_error_naming_it(tmp_path):
    with pytest.raises(hostdevices.HostDevicesError, match="absent: No such file"):
        hostdevices.nvidia_majors(str(tmp_path / "absent"))


def test_the_hosts_node_of_a_name():
    assert hostdevices.host_node("/dev/null") == HostNode("c", 1, 3)
    assert hostdevices.host_node("/dev/nvidia-uvm-absent") is None
    assert hostdevices.host_node(os.path.abspath(__file__)) == HostNode("-", 0, 0)
