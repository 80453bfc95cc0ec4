"""The book's prose: every chapter teaches in the same frame and never contradicts the data.

- objectives and prerequisites first, a summary and further reading last, at least one citation;
- no words about how the book was made (issues, sessions, commits, scratch notes) and no commit hashes;
- no measured number typed into prose: a time or a rate (µs, ms, TFLOP/s, TB/s, GB/s) in a markdown
  cell comes from recorded data through myst-nb's ``{glue}`` roles, so chapters cannot disagree.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
PAGES = [ROOT / "intro.md", ROOT / "status.md", ROOT / "glossary.md"]

PROCESS = re.compile(r"\b(the issue|issues? #?\d+|commit(s|ted)?\b|\.notes/|scratch notes?"
                     r"|pull request|TODO\b(?!`))", re.I)
# 7 to 40 hex digits with at least one digit and one letter, standing alone: a commit hash
HASH = re.compile(r"(?<![\w#/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/.-])")
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)?\s*(?:–\s*\d[\d.]*\s*)?(TFLOP/s|µs|us\b|ms\b|TB/s|GB/s)")


def _markdown(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _prose(text: str) -> str:
    """Markdown without code (fenced blocks, inline code, math), where numbers and words are the program's."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\$[^$]*\$", "", text)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_objectives_summary_and_citations(path):
    cells = _markdown(path)
    text = "\n".join(cells)
    heads = [h.lower() for h in re.findall(r"^#{2,4} +(.*)$", text, re.M)]
    opening = "\n".join(cells[:3]).lower()
    assert "objectives" in opening, "the first markdown cells say what the chapter teaches (Objectives)"
    assert "prerequisites" in opening, "... and what the reader needs first (Prerequisites)"
    assert any(h.startswith("summary") for h in heads), "a '## Summary' section"
    assert any(h.startswith("further reading") for h in heads), "a '## Further reading' section"
    assert "{cite" in text, "at least one citation ({cite:p}`key` from references.bib)"


@pytest.mark.parametrize("path", CHAPTERS + PAGES, ids=lambda p: p.stem)
def test_text_speaks_only_of_the_book(path):
    texts = _markdown(path) if path.suffix == ".ipynb" else [path.read_text(encoding="utf-8")]
    for text in texts:
        prose = _prose(text)
        assert not PROCESS.findall(prose), (path.name, PROCESS.findall(prose), prose[:200])
        assert not HASH.findall(prose), (path.name, HASH.findall(prose))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_measured_numbers_come_from_glue(path):
    for text in _markdown(path):
        typed = [m.group(0) for m in MEASURED.finditer(_prose(text))]
        assert not typed, f"{path.name}: {typed} typed by hand; glue them from the recorded data"


def test_every_citation_key_is_in_the_bibliography():
    keys = set(re.findall(r"@\w+\{([^,]+),", (ROOT / "references.bib").read_text(encoding="utf-8")))
    for path in CHAPTERS:
        for text in _markdown(path):
            for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text):
                for key in group.split(","):
                    assert key.strip() in keys, f"{path.name} cites {key.strip()!r}, not in references.bib"
