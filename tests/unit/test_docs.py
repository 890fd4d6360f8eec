"""The documentation held to the code: every citation of docs/architecture.md names a
heading (and a paragraph) it has; nothing cites a design document the repository does
not hold; the package table, the paths and the flags the README and the architecture
name exist; every module is in the package table; and a module longer than
`LONG_MODULE` lines says at its top why it is one piece."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LONG_MODULE = 450  # lines (docs/architecture.md, "7. Package layout")
TEXT_SUFFIXES = {".py", ".proto", ".md", ".yaml", ".yml", ".tpl", ".sh", ".toml", ".txt"}
# Generated: outputs of past benchmark runs, code generated from the protos.
GENERATED = re.compile(r"^benchmarks/results/|_pb2(_grpc)?\.pyi?$")
# A citation: `docs/architecture.md, "N. Title"` (also a Markdown link to it, or the
# relative `architecture.md` of docs/), optionally `, "Paragraph"`: a bold lead there.
CITATION = re.compile(
    r'architecture\.md\)?,\s*(?P<rest>(?:section\s*\d+|"(?P<heading>[^"]+)"'
    r'(?:,\s*"(?P<paragraph>[^"]+)")?))'
)
COMMENT = re.compile(r"^\s*(?:#+|//+|\*|\{\{/?\*|--)?\s?")


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def _text_files() -> list[str]:
    """Source and documentation, not this test (its examples are wrong on purpose)."""
    return [
        p
        for p in _tracked()
        if (Path(p).suffix in TEXT_SUFFIXES or Path(p).name == "Dockerfile")
        and not GENERATED.search(p)
        and p != "tests/unit/test_docs.py"
    ]


def _flat(path: str) -> str:
    """A file's text as one line: comment markers at line starts dropped, so that a
    citation wrapped across comment lines reads as written."""
    lines = (ROOT / path).read_text(errors="replace").splitlines()
    return " ".join(COMMENT.sub("", line).strip() for line in lines)


@cache
def _sections() -> dict[str, str]:
    """docs/architecture.md's numbered headings ("N. Title") and their text."""
    sections: dict[str, str] = {}
    current = None
    for line in ARCHITECTURE.read_text().splitlines():
        m = re.match(r"^## (\d+\. .+?)\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def _bold_leads(section: str) -> set[str]:
    return {" ".join(m.split()) for m in re.findall(r"\*\*([^*]+)\*\*", _sections()[section])}


def test_every_citation_of_the_architecture_names_what_it_has() -> None:
    assert len(_sections()) >= 10, list(_sections())
    wrong, found = [], 0
    for path in _text_files():
        for m in CITATION.finditer(_flat(path)):
            found += 1
            heading = m.group("heading")
            paragraph = m.group("paragraph")
            if heading is None:
                wrong.append(f"{path}: {m.group(0)!r} (cite a heading by its number and title)")
            elif heading not in _sections():
                wrong.append(f"{path}: no heading {heading!r}")
            elif paragraph is not None and paragraph not in _bold_leads(heading):
                wrong.append(f"{path}: no paragraph **{paragraph}** in {heading!r}")
    assert found > 20  # the pattern still finds the citations
    assert not wrong, "\n".join(wrong)


def test_the_citation_check_can_fail() -> None:
    text = 'x (docs/architecture.md, "9. Security") y (docs/architecture.md, "2.6") z'
    text += ' (docs/architecture.md, section 6, "Leases")'
    cited = [(m.group("heading"), m.group("rest")) for m in CITATION.finditer(text)]
    assert cited == [("9. Security", '"9. Security"'), ("2.6", '"2.6"'), (None, "section 6")]
    assert "9. Security" in _sections() and "2.6" not in _sections()
    assert "Emulated devices" in _bold_leads("5. The request controller and its executors")


def test_nothing_cites_a_design_document_outside_the_repository() -> None:
    """The project's design notes are not in the repository: citations go to
    docs/architecture.md (or docs/planning.md, docs/deploy.md)."""
    cited = [
        f"{p}: {m.group(0)!r}"
        for p in _text_files()
        for m in re.finditer(r"\bDESIGN\b[^\n]{0,20}", (ROOT / p).read_text(errors="replace"))
    ]
    assert not cited, "\n".join(cited)


def _package_table() -> list[tuple[str, list[str]]]:
    """Section 7's table: (package prefix, the paths of one row), resolved against the
    repository root."""
    rows, package = [], ""
    for line in _sections()["7. Package layout"].splitlines():
        if not line.startswith("| ") or line.startswith("| module") or line.startswith("|--"):
            continue
        first = line.split("|")[1].strip()
        bold = re.fullmatch(r"\*\*`([^`]+)`\*\*", first)
        if bold:
            package = bold.group(1)
            rows.append((package, [package]))
            continue
        names = re.findall(r"`([^`]+)`", first)
        paths = [n if n.split("/")[0] in ("common", "specpipe") else package + n for n in names]
        rows.append((package, paths))
    return rows


def test_every_module_of_the_package_table_exists() -> None:
    paths = [p for _, row in _package_table() for p in row]
    assert len(paths) > 50, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_module_is_in_the_package_table() -> None:
    """A reader finds every module of common/ and services/ in the table (a folder's row,
    like `transport/`, covers the folder)."""
    listed = {p.rstrip("/") for _, row in _package_table() for p in row}
    missing = []
    for path in _tracked():
        parts = Path(path).parts
        if parts[0] not in ("common", "services") or not path.endswith(".py"):
            continue
        if Path(path).name == "__init__.py":
            continue
        covered = any("/".join(parts[:n]) in listed for n in range(2, len(parts) + 1))
        if not covered:
            missing.append(path)
    assert not missing, f"add to docs/architecture.md, '7. Package layout': {missing}"


REPO_PATH = re.compile(
    r"`((?:common|services|specpipe|protos|helm|k8s|docs|benchmarks|tests|scripts|docker)"
    r"/[\w./-]*)`"
)


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_paths_the_docs_name_exist(doc: str) -> None:
    named = set(REPO_PATH.findall((ROOT / doc).read_text()))
    assert len(named) > 10
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


# Flags of other tools the README shows beside specpipe's.
OTHER_FLAGS = {
    "--check": "ruff format",
    "--scripted": "benchmarks/bench_layers.py",
    "--wheels": "scripts/setup.sh, scripts/gpu_check.sh",
    "--have": "scripts/download_wheels.py",
    "--python-version": "scripts/download_wheels.py",
    "--cuda": "scripts/download_wheels.py",
    "--limit-mib": "scripts/download_wheels.py",
    "--extras": "scripts/setup.sh, scripts/build_image.sh",
}


def _specpipe_flags() -> set[str]:
    from specpipe.cli import build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    return flags


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_flags_the_docs_name_are_flags(doc: str) -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (ROOT / doc).read_text()))
    unknown = sorted(named - _specpipe_flags() - set(OTHER_FLAGS))
    assert not unknown, unknown


def _module_docstring(path: str) -> str:
    return ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""


def test_a_long_module_says_why_it_is_one_piece() -> None:
    """Past `LONG_MODULE` lines, a module's docstring says why it is one module (a
    sentence with "one module" or "one piece" in it); tests and generated code aside."""
    unexplained = []
    for path in _tracked():
        if not path.endswith(".py") or GENERATED.search(path) or path.startswith("tests/"):
            continue
        lines = (ROOT / path).read_text().count("\n")
        why = re.search(r"\bone (module|piece)\b", _module_docstring(path), re.I)
        if lines > LONG_MODULE and not why:
            unexplained.append(f"{path} ({lines} lines)")
    assert not unexplained, unexplained
