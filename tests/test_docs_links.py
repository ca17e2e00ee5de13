"""Every relative link in README.md and docs/ points at a file or folder of the repository, and every
`see docs/...md` in the source names a page that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
SOURCE_REF = re.compile(r"docs/[\w./-]+\.md")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are examples
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to paths that do not exist: {missing}"


def test_design_notes_named_in_the_source_exist():
    missing = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for ref in SOURCE_REF.findall(path.read_text()):
            if not (ROOT / ref).exists():
                missing.setdefault(ref, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"the source names docs pages that do not exist: {missing}"


def test_result_files_named_in_the_docs_exist():
    results = ROOT / "bench" / "results"
    named = {m for page in PAGES for m in re.findall(r"`((?:H200|cpu|accuracy)-[\w.-]+\.(?:md|log|json))`",
                                                      page.read_text())}
    assert named, "the docs name no result files: the pattern above is stale"
    assert not sorted(n for n in named if not (results / n).exists())
