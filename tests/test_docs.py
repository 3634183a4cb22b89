"""The Markdown pages read as written: no paragraph repeated, no page swollen past reading."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "k8s" / "README.md"])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_repeats_no_paragraph(page: Path) -> None:
    text = page.read_text()
    assert len(text.splitlines()) < 1000, f"{page.name}: {len(text.splitlines())} lines"
    # Prose only: a command or a table header may rightly appear once per machine.
    paragraphs = [p.strip() for p in text.split("\n\n")
                  if len(p.strip()) > 80 and not p.strip().startswith(("```", "|"))]
    repeated = [p[:80] for p, n in Counter(paragraphs).items() if n > 1]
    assert not repeated, f"{page.name} repeats: {repeated}"
