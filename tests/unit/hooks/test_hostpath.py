"""Pins hooks.hostpath to posixpath, whose answers the hook relied on before it stopped
importing ``os``: join, split, dirname, isabs and normpath on random paths; realpath on
random trees of symlinks (relative and absolute targets, ``..`` through links, dangling
links, loops), from a random working directory; the file-type tests on real files."""

import os
import posixpath
import stat
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from hooks import hostpath

NAMES = st.sampled_from(["a", "b", "c", "l1", "l2", "l3", ".", "..", "", "d"])
PATHS = st.lists(NAMES, max_size=8).map("/".join)
ABSOLUTE_OR_NOT = st.tuples(st.sampled_from(["", "/", "//", "///"]), PATHS).map("".join)


@given(st.lists(ABSOLUTE_OR_NOT, min_size=1, max_size=4))
def test_join_as_posixpath(parts):
    """join starts over at an absolute part and puts one separator between parts."""
    assert hostpath.join(*parts) == posixpath.join(*parts)


@given(ABSOLUTE_OR_NOT)
def test_split_dirname_isabs_normpath_as_posixpath(path):
    """split keeps a head of separators only; normpath keeps exactly two leading ones."""
    assert hostpath.split(path) == posixpath.split(path)
    assert hostpath.dirname(path) == posixpath.dirname(path)
    assert hostpath.isabs(path) == posixpath.isabs(path)
    assert hostpath.normpath(path) == posixpath.normpath(path)


# Asked in every tree as well: climbing above the start (a relative ``..`` kept), and
# ``..`` right after a link.
TRICKY = ["../..", "../../a", "..", "l1/../..", "a/l1/..", "l2/l3/../c", "/l1/..", "a/../../b"]
LINK_TARGETS = st.one_of(PATHS, ABSOLUTE_OR_NOT).filter(bool)  # a symlink's target is not empty


@settings(max_examples=150, deadline=None)
@given(
    links=st.dictionaries(st.sampled_from(["l1", "l2", "l3", "a/l1", "b/l2"]), LINK_TARGETS),
    queries=st.lists(ABSOLUTE_OR_NOT, min_size=1, max_size=5),
    cwd=st.sampled_from(["", "a", "b"]),
)
def test_realpath_as_posixpath_on_trees_of_symlinks(links, queries, cwd):
    """Every symlink followed as posixpath.realpath follows it (loops and dangling links
    included), relative paths from the working directory, absolute ones under the tree."""
    with tempfile.TemporaryDirectory() as root:
        for directory in ("a", "b", "d"):
            os.mkdir(os.path.join(root, directory))
        with open(os.path.join(root, "c"), "w"):
            pass
        for link, target in links.items():
            # Absolute targets point into the tree, so the walk stays in it.
            os.symlink(root + target if target.startswith("/") else target, f"{root}/{link}")
        before = os.getcwd()
        os.chdir(os.path.join(root, cwd))
        try:
            for query in [*queries, *TRICKY]:
                path = root + query if query.startswith("/") else query
                assert hostpath.realpath(path) == posixpath.realpath(path), path
        finally:
            os.chdir(before)


def test_file_types_as_stat():
    """is_regular and is_char_device read the mode as stat.S_ISREG and S_ISCHR do."""
    with tempfile.NamedTemporaryFile() as regular:
        for path in (regular.name, "/dev/null", "/", "/proc/self/fd/0"):
            mode = os.stat(path).st_mode
            assert hostpath.is_regular(mode) == stat.S_ISREG(mode)
            assert hostpath.is_char_device(mode) == stat.S_ISCHR(mode)
