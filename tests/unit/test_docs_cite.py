"""The README's "How it works" and the protos' comments name only what exists.

Both are read before the code, so a name they cite that was renamed or removed sends a
newcomer looking for something that is not there (issue 37: the README said the router
draws the token, the protos that the last stage sends logits and the cache is
preallocated). Every path they cite must exist, and every identifier they cite must be
defined somewhere: a Python class or function, a protobuf message, enum, field or RPC.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos" / "specpipe" / "v1").glob("*.proto"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# CamelCase words in proto comments that are names of things outside this code base.
OUTSIDE_NAMES = {
    "SpecInfer", "SpecPipe", "PyTorch", "NumPy", "OpenAI", "StatusCode", "EndpointSlice",
    "EndpointSlices",
}  # fmt: skip

BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(
    r"^(?:common|services|specpipe|protos|tests|benchmarks|scripts|docs|helm|k8s|docker)/[\w./-]*$"
)
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?$")
CAMEL = re.compile(r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b")


@cache
def defined_names() -> frozenset[str]:
    """Names defined in the code base: Python defs, classes, module-level names and
    attributes set on self; protobuf messages, enums, values, fields and RPCs."""
    names: set[str] = set()
    python = re.compile(
        r"^\s*(?:async\s+def|def|class)\s+(\w+)|^(\w+)\s*[:=]|self\.(\w+)\s*[:=]", re.M
    )
    field = re.compile(r"^\s*(\w+)\s*[:=]", re.M)  # dataclass fields and class attributes
    for folder in ("common", "services", "specpipe"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            names.add(path.stem)
            for match in python.finditer(text):
                names.update(n for n in match.groups() if n)
            names.update(field.findall(text))
    proto = re.compile(
        r"^\s*(?:message|enum|service|rpc)\s+(\w+)|^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=|^\s*(\w+)\s*=\s*\d+;",
        re.M,
    )
    for path in PROTOS:
        for match in proto.finditer(path.read_text()):
            names.update(n for n in match.groups() if n)
    return frozenset(names)


def how_it_works() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## How it works")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def proto_comments(path: Path) -> str:
    return "\n".join(
        line.split("//", 1)[1] for line in path.read_text().splitlines() if "//" in line
    )


def cited_identifiers(text: str) -> list[str]:
    """Backticked tokens that read as code names (not flags, values or expressions)."""
    out = []
    for token in BACKTICKED.findall(text):
        if PATH.match(token) or not IDENTIFIER.match(token):
            continue
        bare = token.removesuffix("()")
        if "_" in bare or "." in bare or CAMEL.fullmatch(bare):
            out.append(bare.rsplit(".", 1)[-1])
    return out


def missing(names: list[str]) -> list[str]:
    defined = defined_names()
    return sorted({n for n in names if n not in defined})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_cites_exists(doc: Path) -> None:
    cited = {t.rstrip("/") for t in BACKTICKED.findall(doc.read_text()) if PATH.match(t)}
    cited = {t.split(":")[0] for t in cited if "*" not in t}
    assert not [p for p in sorted(cited) if not (ROOT / p).exists()]


def test_how_it_works_names_only_what_exists() -> None:
    assert missing(cited_identifiers(how_it_works())) == []


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_proto_comments_name_only_what_exists(proto: Path) -> None:
    comments = proto_comments(proto)
    camel = [w for w in CAMEL.findall(comments) if w not in OUTSIDE_NAMES]
    assert missing(camel + cited_identifiers(comments)) == []


def test_the_check_catches_a_stale_name() -> None:
    """The checks above fail on a name that is not defined (so they cannot pass vacuously)."""
    assert missing(cited_identifiers("the `RouterService.draw_logits_on_router` step")) == [
        "draw_logits_on_router"
    ]
    assert "verify_many" in defined_names() and "Verification" in defined_names()
