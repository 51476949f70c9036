"""Citations of docs/architecture.md point at sections that exist, and nothing cites a file outside the repo.

Code comments cite ``docs/architecture.md#<anchor>``; a renamed heading would leave them pointing
nowhere, so every cited anchor is checked against the headings, slugged the way GitHub does.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SEARCHED = ("kvtier", "tests", "benchmarks", "examples", "docs", "README.md")
SUFFIXES = {".py", ".md", ".cu", ".yaml", ".yml", ".sh", ".txt"}
#: Files still citing DESIGN.md while other branches rewrite them; the replacement lines are listed in
#: issue 16's closing note. Empty this once they are merged.
PENDING_DESIGN_CITATIONS: set[str] = set()

_CITATION = re.compile(r"architecture\.md#([A-Za-z0-9_-]+)")
_DESIGN = re.compile(r"DESIGN(\.md|\s*§)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", ARCHITECTURE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {github_anchor(h) for h in headings}


def _files() -> list[Path]:
    files: list[Path] = []
    for name in SEARCHED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES)
    return files


def test_github_anchor_matches_githubs_rules() -> None:
    assert github_anchor("Failure contract") == "failure-contract"
    assert github_anchor("Keys, blocks and layouts") == "keys-blocks-and-layouts"
    assert github_anchor("vLLM semantics") == "vllm-semantics"
    assert github_anchor("`kvtier replay`") == "kvtier-replay"


def test_every_cited_architecture_section_exists() -> None:
    anchors = _anchors()
    cited: dict[str, list[str]] = {}
    for path in _files():
        for anchor in _CITATION.findall(path.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(anchor, []).append(str(path.relative_to(ROOT)))
    for anchor in re.findall(r"\]\(#([A-Za-z0-9_-]+)\)", ARCHITECTURE.read_text(encoding="utf-8")):
        cited.setdefault(anchor, []).append("docs/architecture.md (a link inside it)")
    assert cited, "nothing cites docs/architecture.md: the search found no files"
    missing = {anchor: where for anchor, where in cited.items() if anchor not in anchors}
    assert not missing, f"cited sections missing from docs/architecture.md: {missing}"


def test_nothing_cites_design_md_outside_the_repo() -> None:
    citing = sorted(str(path.relative_to(ROOT)) for path in _files()
                    if _DESIGN.search(path.read_text(encoding="utf-8", errors="replace")))
    unexpected = [name for name in citing if name not in PENDING_DESIGN_CITATIONS | {"tests/test_docs.py"}]
    assert not unexpected, f"these files cite DESIGN.md, which is not in the repository: {unexpected}"
