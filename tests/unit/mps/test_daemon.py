"""Pins CardDaemon.publish, what containers see of a card's daemon: the client directory
holds only ``control``, the daemon's current socket (a hard link, replaced in one rename
when the daemon made a new one, left alone when it is current), nothing a publish
stopped midway left behind; a socket that cannot be linked is an MpsError naming the
card and the fix."""

from __future__ import annotations

import os
import socket

import pytest

from mps import CardDaemon, MpsError

GPU = "GPU-5ad00000-0000-4000-8000-000000000000"


@pytest.fixture
def card(tmp_path):
    (tmp_path / "pipe").mkdir()
    return CardDaemon(
        GPU, "unused", str(tmp_path / "pipe"), str(tmp_path / "log"), 1, str(tmp_path / "client")
    )


def bind_control(card: CardDaemon) -> socket.socket:
    """A new socket at the pipe directory's ``control`` (what a daemon's start does)."""
    path = os.path.join(card.pipe_dir, "control")
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    return listener


def shown(card: CardDaemon) -> str:
    return os.path.join(card.client_dir, "control")


def test_the_client_directory_holds_only_the_current_control_socket(card):
    """Published: only ``control``, the very socket file; a new daemon's socket replaces
    it; a publish with nothing new changes nothing (same file)."""
    with bind_control(card):
        card.publish()
        assert os.listdir(card.client_dir) == ["control"]
        assert os.path.samefile(shown(card), os.path.join(card.pipe_dir, "control"))
        before = os.lstat(shown(card))
        card.publish()
        assert os.lstat(shown(card)).st_ino == before.st_ino
    with bind_control(card):
        assert not os.path.samefile(shown(card), os.path.join(card.pipe_dir, "control"))
        card.publish()
        assert os.path.samefile(shown(card), os.path.join(card.pipe_dir, "control"))
        assert os.listdir(card.client_dir) == ["control"]


def test_what_a_stopped_publish_left_is_removed(card):
    """A temporary link left by a run stopped between its link and its rename goes."""
    with bind_control(card):
        os.makedirs(card.client_dir)
        os.link(os.path.join(card.pipe_dir, "control"), os.path.join(card.client_dir, ".control.1"))
        card.publish()
        assert os.listdir(card.client_dir) == ["control"]


def test_a_socket_that_cannot_be_linked_is_an_error_naming_the_card(card):
    """No socket to link (no daemon ever started there): MpsError with the card, both
    paths and what they need."""
    with pytest.raises(MpsError, match=f"control socket of {GPU}.*one file system"):
        card.publish()


def test_no_client_directory_publishes_nothing(tmp_path):
    """A CardDaemon without a client directory (a test's, a tool's) touches nothing."""
    card = CardDaemon(GPU, "unused", str(tmp_path / "pipe"), str(tmp_path / "log"), 1)
    card.publish()
    assert os.listdir(tmp_path) == []


def test_a_pipe_directory_too_long_for_its_sockets_is_refused_naming_the_fix(tmp_path):
    """A unix socket path holds at most 107 bytes: a pipe directory whose
    ``control_privileged`` would be longer cannot work (the binary only says it cannot
    access CUDA_MPS_PIPE_DIRECTORY), so the start is refused first, naming the path, its
    length and the fix, and the binary is not run."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    card = CardDaemon(GPU, "/nonexistent/binary", str(deep / "pipe"), str(deep / "log"), 1)
    with pytest.raises(MpsError) as error:
        card.start()
    socket_path = os.path.join(card.pipe_dir, "control_privileged")
    assert str(error.value) == (
        f"the MPS control socket {socket_path} would be {len(socket_path.encode())} bytes, "
        f"over the 107 a unix socket path may have: give gpushare-node a shorter run_dir"
    )
