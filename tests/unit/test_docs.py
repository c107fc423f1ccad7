"""The docs and comments stand alone: every pointer in them leads to a file of this repository.

Pins:
- every relative Markdown link in README.md, docs/*.md and deploy/README.md
  resolves to a file or directory inside the checkout;
- every repository path named in a tracked text file (code, comments,
  docstrings, docs, scripts, configs) exists, and every ``nodemgr.<module>``
  named there is a module of the package (with the name after it, if any,
  defined in that module), so a moved or renamed file cannot leave stale
  mentions behind;
- nothing points at notes kept outside the repository: the facts the code
  relies on are in docs/ (kubelet-api.md, mps.md, gpushare-compat.md).

Files are the checkout's tracked and untracked-but-not-ignored ones (``git
ls-files``, read only), so a new file is checked before it is committed.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.harness.paths import REPO

ROOT = Path(REPO)
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Pointers that are meant not to resolve: (file, mention) -> why. Keep it short.
ALLOWED_MISSING: dict[tuple[str, str], str] = {}

# --------------------------------------------------------------------- files


@cache
def repo_files() -> tuple[str, ...]:
    """Tracked and untracked, not ignored, files that exist now (repo-relative, sorted)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files to scan come from git ls-files")
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    return tuple(sorted({f for f in listed.split("\0") if f and (ROOT / f).is_file()}))


@cache
def text_of(path: str) -> str | None:
    """A file's text, or None for a binary file."""
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_files() -> list[tuple[str, str]]:
    return [(f, t) for f in repo_files() if (t := text_of(f)) is not None]


def markdown_files() -> list[str]:
    names = ["README.md", "deploy/README.md", *(f"docs/{p.name}" for p in ROOT.glob("docs/*.md"))]
    return sorted(n for n in names if (ROOT / n).is_file())


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ------------------------------------------------------ (a) Markdown links

_FENCED_BLOCK = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
_INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _blank(match: re.Match) -> str:
    """Code replaced by spaces (newlines kept), so offsets and line numbers stay right."""
    return re.sub(r"[^\n]", " ", match.group(0))


def markdown_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    prose = _CODE_SPAN.sub(_blank, _FENCED_BLOCK.sub(_blank, text))
    found = []
    for pattern in (_INLINE_LINK, _REFERENCE_DEFINITION):
        found += [(line_of(prose, m.start()), m.group(1)) for m in pattern.finditer(prose)]
    return sorted(found)


def broken_link(markdown_file: str, target: str) -> str | None:
    """Why a link target does not resolve inside the checkout; None if it does or is external."""
    if _SCHEME.match(target):  # http:, https:, mailto:
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None  # an anchor in the same file
    if path.startswith("/"):
        return "an absolute path, outside any checkout"
    resolved = ((ROOT / markdown_file).parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return "leads outside the repository"
    if not resolved.exists():
        return "no such file"
    return None


def test_relative_markdown_links_resolve_to_files_in_the_repository():
    """Every relative link in README.md, docs/*.md and deploy/README.md names an existing
    file or directory of the checkout (anchors stripped; http(s) and mailto links ignored)."""
    files = markdown_files()
    assert "README.md" in files and "deploy/README.md" in files
    broken, checked = [], 0
    for name in files:
        for line, target in markdown_links((ROOT / name).read_text()):
            checked += 1
            why = broken_link(name, target)
            if why:
                broken.append(f"{name}:{line}: ({target}): {why}")
    assert checked > 0, "no Markdown link found: the link pattern is broken"
    assert not broken, "Markdown links that do not resolve:\n" + "\n".join(broken)


# ------------------------------------------------- (b) repository paths


@cache
def top_level_dirs() -> tuple[str, ...]:
    return tuple(sorted({f.split("/", 1)[0] for f in repo_files() if "/" in f}))


def path_mention_pattern() -> re.Pattern:
    """``bench/suite.py``, ``tests/unit/deploy/test_render.py``, ``deploy/``: a path that
    starts with a top-level directory of the repository. Not when the directory name
    continues another path or word (``/etc/systemd/...``, ``<run_dir>/mps/...``,
    ``$OUT/docs``, ``example.io/docs/...``, URLs), and not through ``<``, ``{`` or
    blanks (placeholders and format strings end the mention)."""
    names = "|".join(re.escape(d) for d in top_level_dirs())
    return re.compile(rf"(?<![\w./<>$@:~%+-])((?:{names})/[\w./*-]*)")


def path_exists(mention: str) -> bool:
    if "*" in mention:  # a glob, e.g. nodemgr/kubelet/api/*.proto
        return any(ROOT.glob(mention))
    return (ROOT / mention).exists()


def test_repository_paths_named_in_files_exist():
    """Every repository path named in a tracked text file (docs, comments, docstrings,
    scripts, configs: e.g. a test file a doc cites) exists, or matches a file if it is
    a glob; so a moved file cannot leave a stale mention behind."""
    pattern = path_mention_pattern()
    missing, checked = [], 0
    for name, text in text_files():
        for match in pattern.finditer(text):
            mention = match.group(1).rstrip(".")
            checked += 1
            if (name, mention) in ALLOWED_MISSING or path_exists(mention):
                continue
            missing.append(f"{name}:{line_of(text, match.start())}: {mention}")
    assert checked > 0, "no repository path found: the path pattern is broken"
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


_MODULE_MENTION = re.compile(r"(?<![\w.])nodemgr(?:\.[A-Za-z_]\w*)+")


def module_problem(dotted: str) -> str | None:
    """Why a dotted ``nodemgr`` name names no module of the package (or no name in it)."""
    first, *rest = dotted.split(".")
    package = ROOT / first
    module_file = package / "__init__.py"
    while rest:
        below = package / rest[0]
        if (below / "__init__.py").is_file():
            package, module_file = below, below / "__init__.py"
            rest.pop(0)
        elif below.with_suffix(".py").is_file():
            module_file = below.with_suffix(".py")
            rest.pop(0)
            break
        else:
            break
    if not rest:
        return None
    name = re.escape(rest[0])
    defined = re.compile(
        rf"^(?:async\s+def|def|class)\s+{name}\b"  # def or class at module level
        rf"|^{name}\b\s*(?::|=|,)"  # NAME = ..., NAME: type = ..., NAME, OTHER = ...
        rf"|^(?:from\s+\S+\s+)?import\b[^\n]*\b{name}\b"  # imported on one line
        rf"|^\s+{name}(?:\s+as\s+\w+)?,?\s*$",  # one name of a parenthesised import
        re.M,
    )
    if defined.search(module_file.read_text()):
        return None
    where = module_file.relative_to(ROOT)
    return f"{rest[0]!r} is neither a module below nor a name defined in {where}"


def test_nodemgr_modules_named_in_files_exist():
    """Every ``nodemgr.<package>.<module>`` named in a tracked text file is a module of the
    package, and a name after it (``nodemgr.kubernetes.publish.node_labels``) is defined
    there; so a renamed module cannot leave stale mentions behind."""
    problems, checked = [], 0
    for name, text in text_files():
        for match in _MODULE_MENTION.finditer(text):
            checked += 1
            problem = module_problem(match.group(0))
            if problem:
                problems.append(
                    f"{name}:{line_of(text, match.start())}: {match.group(0)}: {problem}"
                )
    assert checked > 0, "no nodemgr module named anywhere: the pattern is broken"
    assert not problems, "nodemgr modules named but not there:\n" + "\n".join(problems)


# ------------------------------------------- (c) no pointers outside the repository

# The patterns are spelled in pieces ("refer" "ence") so that this file does not itself
# read as a pointer to a file outside the repository.
_OUTSIDE_POINTER = re.compile(
    r"\bshared/refer"
    r"ence\b"  # the reference notes, at any depth
    r"|\bshared/design\.md\b"
    r"|\.\./shared\b"  # the checkout's sibling directory
    r"|(?<![\w./-])refer"
    r"ence/[\w.-]+\.md\b"  # a notes file by name, e.g. mps.md
)


def test_no_pointer_to_notes_outside_the_repository():
    """No file points at reference notes or a design document kept outside the
    repository (``reference/<topic>.md``, the sibling ``shared`` directory): what the
    code relies on is written down in docs/. (This file names the patterns, so it is
    not scanned.)"""
    found = []
    for name, text in text_files():
        if name == THIS_FILE:
            continue
        for match in _OUTSIDE_POINTER.finditer(text):
            found.append(f"{name}:{line_of(text, match.start())}: {match.group(0)}")
    assert not found, "pointers outside the repository (use docs/...):\n" + "\n".join(found)
