"""The docs and comments stand alone: every pointer in them leads to a file of this repository.

Pins:
- every relative Markdown link in README.md, docs/*.md and deploy/README.md
  resolves to a file or directory inside the checkout, and its ``#anchor``, if any,
  to a heading (or an ``<a id>``) of the Markdown file it names;
- the module lists stay true: every module of a product package (nodemgr, mps,
  hooks) and of the stand-ins' package (standins) is named in its package's
  ``__init__`` docstring list and under its package in docs/layout.md, and every
  name listed there is a module of that package;
- README.md stays a page an admin reads in minutes (the depth is in docs/), and no
  page a user reads, nor the product's code, scripts or benchmarks, cites an issue
  by number;
- every repository path named in a tracked text file (code, comments,
  docstrings, docs, scripts, configs) exists, and every ``nodemgr.<module>``
  or ``standins.<module>`` named there is a module of the package (with the
  name after it, if any, defined in that module), so a moved or renamed file
  cannot leave stale mentions behind;
- nothing points at notes kept outside the repository: the facts the code
  relies on are in docs/ (kubelet-api.md, mps.md, gpushare-compat.md).

Files are the checkout's tracked and untracked-but-not-ignored ones (``git
ls-files``, read only), so a new file is checked before it is committed.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from standins.paths import REPO

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


_ATX_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']", re.I)
_INLINE_MARKUP = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")  # a link in a heading: its text


def heading_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, every
    character but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``."""
    text = _INLINE_MARKUP.sub(r"\1", heading).replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors_of(markdown_file: Path) -> frozenset[str]:
    """Every anchor a Markdown file has: one per heading outside code (a repeated one
    gets ``-1``, ``-2``, ... as on GitHub), and each ``<a id>``/``<a name>``."""
    text = markdown_file.read_text()
    prose = _FENCED_BLOCK.sub(_blank, text)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in _ATX_HEADING.finditer(prose):
        slug = heading_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(_HTML_ANCHOR.findall(text))
    return frozenset(found)


def broken_link(markdown_file: str, target: str) -> str | None:
    """Why a link target does not resolve inside the checkout; None if it does or is external.
    An anchor must name a heading of the Markdown file linked (or of this file)."""
    if _SCHEME.match(target):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    path = path.split("?", 1)[0]
    if path.startswith("/"):
        return "an absolute path, outside any checkout"
    if not path:  # an anchor in the same file
        resolved = ROOT / markdown_file
    else:
        resolved = ((ROOT / markdown_file).parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return "leads outside the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
        return f"no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def test_heading_anchors_are_made_as_github_makes_them(tmp_path):
    """The anchors the link check accepts are GitHub's: code marks and punctuation
    dropped, spaces made hyphens, a repeated heading numbered; code blocks have none."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Operating a node: systemd, `nodemgr status`\n"
        "## Installing (systemd): `nodemgr install`\n"
        "### `nodemgr/cli/doctor/`\n"
        "## /dev/shm\n## /dev/shm\n"
        "```\n# not a heading\n```\n"
        '<a id="kept-by-hand"></a>\n'
    )
    assert anchors_of(page) == {
        "operating-a-node-systemd-nodemgr-status",
        "installing-systemd-nodemgr-install",
        "nodemgrclidoctor",
        "devshm",
        "devshm-1",
        "kept-by-hand",
    }


def test_relative_markdown_links_resolve_to_files_in_the_repository():
    """Every relative link in README.md, docs/*.md and deploy/README.md names an existing
    file or directory of the checkout, and an anchor in it a heading of the Markdown file
    it names (http(s) and mailto links ignored)."""
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


_MODULE_MENTION = re.compile(r"(?<![\w.])(?:nodemgr|standins)(?:\.[A-Za-z_]\w*)+")


def module_problem(dotted: str) -> str | None:
    """Why a dotted ``nodemgr`` or ``standins`` name names no module of the package (or
    no name in it)."""
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
    if not rest or re.fullmatch(r"__\w+__", rest[0]):  # every module has __file__, ...
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
    """Every ``nodemgr.<package>.<module>`` (or ``standins.<module>``) named in a tracked
    text file is a module of the package, and a name after it
    (``nodemgr.kubernetes.publish.node_labels``) is defined there; so a renamed module
    cannot leave stale mentions behind."""
    problems, checked, stand_ins = [], 0, 0
    for name, text in text_files():
        for match in _MODULE_MENTION.finditer(text):
            checked += 1
            stand_ins += match.group(0).startswith("standins.")
            problem = module_problem(match.group(0))
            if problem:
                problems.append(
                    f"{name}:{line_of(text, match.start())}: {match.group(0)}: {problem}"
                )
    assert checked > 0, "no nodemgr module named anywhere: the pattern is broken"
    assert stand_ins > 0, "no standins module named anywhere: the pattern is broken"
    assert not problems, "modules named but not there:\n" + "\n".join(problems)


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


# ------------------------------------------------------------ (d) module lists

PRODUCT_PACKAGES = ("nodemgr", "mps", "hooks")
# The packages whose module lists are kept: the product's and the stand-ins' (shipped too).
LISTED_PACKAGES = (*PRODUCT_PACKAGES, "standins")
LAYOUT = "docs/layout.md"
# A list item naming modules: "- ``a``: ...", "- ``a``, ``b`` and ``c``: ..." (docstrings,
# reStructuredText literals) or the same with single backticks (docs/layout.md).
_JOIN = r"(?:,\s+and\s+|,\s+|\s+and\s+)"
_DOCSTRING_ITEM = re.compile(rf"^- ((?:``\w+``{_JOIN})*``\w+``):", re.M)
_LAYOUT_ITEM = re.compile(rf"^- ((?:`\w+`{_JOIN})*`\w+`):", re.M)
_ITEM_NAME = re.compile(r"`+(\w+)`+")
_LAYOUT_PACKAGE = re.compile(r"^#{2,3} `([\w/]+)/`$", re.M)


def listed_packages() -> dict[str, set[str]]:
    """Each package whose modules are listed (the product's and ``standins``; repo-relative
    path) and its modules: its .py files but ``__init__`` and generated gRPC code
    (``*_pb2*``), and its sub-packages."""
    packages = {}
    for top in LISTED_PACKAGES:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent
            modules = {
                entry.stem if entry.suffix == ".py" else entry.name
                for entry in package.iterdir()
                if (entry.suffix == ".py" and entry.stem != "__init__" and "_pb2" not in entry.stem)
                or (entry / "__init__.py").is_file()
            }
            packages[package.relative_to(ROOT).as_posix()] = modules
    return packages


def listed_in_docstring(package: str) -> set[str]:
    """The modules a package's ``__init__`` docstring lists."""
    docstring = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
    return {
        name for item in _DOCSTRING_ITEM.findall(docstring) for name in _ITEM_NAME.findall(item)
    }


def listed_in_layout() -> dict[str, set[str]]:
    """The modules docs/layout.md lists under each package's heading."""
    text = (ROOT / LAYOUT).read_text()
    headings = list(_LAYOUT_PACKAGE.finditer(text))
    listed: dict[str, set[str]] = {}
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        section = text[heading.end() : following.start() if following else len(text)]
        section = re.split(r"^#{1,6} ", section, maxsplit=1, flags=re.M)[0]
        names = {n for item in _LAYOUT_ITEM.findall(section) for n in _ITEM_NAME.findall(item)}
        listed[heading.group(1)] = names
    return listed


def list_problems(where: str, modules: set[str], listed: set[str]) -> list[str]:
    problems = []
    if missing := sorted(modules - listed):
        problems.append(f"{where} does not list {missing}")
    if unknown := sorted(listed - modules):
        problems.append(f"{where} lists {unknown}, not modules of the package")
    return problems


def test_package_docstrings_list_every_module_and_only_modules():
    """Each product package's and each stand-ins package's ``__init__`` docstring names
    every one of its modules and sub-packages in a list item (``- ``name``: what``), and
    names nothing else there."""
    packages = listed_packages()
    assert {"nodemgr", "nodemgr/allocation", "mps", "hooks", "standins", "standins/cri"} <= set(
        packages
    )
    problems = []
    for package, modules in packages.items():
        where = f"{package}/__init__.py"
        problems += list_problems(where, modules, listed_in_docstring(package))
    assert not problems, "module lists out of date:\n" + "\n".join(problems)


def test_layout_page_lists_every_module_of_every_package():
    """docs/layout.md has a heading per product or stand-ins package with modules
    (``### `nodemgr/<x>/```, ``## `standins/```) whose list items name every module of
    that package, and only those."""
    packages = {p: m for p, m in listed_packages().items() if m}
    layout = listed_in_layout()
    problems = [f"{LAYOUT} has no section for {p}/" for p in sorted(set(packages) - set(layout))]
    problems += [
        f"{LAYOUT} has a section for {p}/, not a package" for p in set(layout) - set(packages)
    ]
    for package in sorted(set(packages) & set(layout)):
        where = f"{LAYOUT} under {package}/"
        problems += list_problems(where, packages[package], layout[package])
    assert not problems, "docs/layout.md out of date:\n" + "\n".join(problems)


def test_module_list_parsers_read_names_and_catch_drift(tmp_path):
    """The list-item patterns read one name, several joined by commas and "and", and
    ignore names that are not at the start of an item; a drifted list is reported both
    ways (a module not listed, a name listed that is no module)."""
    docstring = (
        "Text naming ``notlisted``.\n- ``a``: x\n- ``b``, ``c`` and ``d``: y (``e``)\n"
        "  - ``f``: an indented item is prose\n"
    )
    assert {n for i in _DOCSTRING_ITEM.findall(docstring) for n in _ITEM_NAME.findall(i)} == {
        "a", "b", "c", "d",
    }  # fmt: skip
    layout = "- `x`, `y`: z\n- `w` words: no colon after the names\n- `u` and\n  `v`: wrapped\n"
    assert _LAYOUT_ITEM.findall(layout) == ["`x`, `y`", "`u` and\n  `v`"]
    assert list_problems("p", {"a", "b"}, {"b", "z"}) == [
        "p does not list ['a']",
        "p lists ['z'], not modules of the package",
    ]


# --------------------------------------------------- (e) what a user reads first

README_MAX_LINES = 300  # about 300 lines: what an admin needs; every deeper topic in docs/
# Where a user reads (pages, command help, messages) and what ships with the product (the
# stand-ins included).
USER_FACING = (
    "README.md",
    "docs/",
    "deploy/",
    "nodemgr/",
    "mps/",
    "hooks/",
    "standins/",
    "scripts/",
    "systemd/",
    "bench/",
)
_ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.I)


def test_readme_stays_short():
    """README.md is a page an admin reads in about ten minutes: at most about 300 lines;
    each deeper topic has its own page in docs/, linked from it."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move depth to docs/"


def test_no_issue_numbers_where_users_read():
    """No issue is cited by number in the docs, the product's code (its command help and
    messages), its scripts or benchmarks: a reader has no issue tracker to look it up in;
    the facts are written out instead."""
    found = []
    for name, text in text_files():
        if not name.startswith(USER_FACING):
            continue
        for match in _ISSUE_NUMBER.finditer(text):
            found.append(f"{name}:{line_of(text, match.start())}: {match.group(0)}")
    assert not found, "issue numbers cited:\n" + "\n".join(found)
