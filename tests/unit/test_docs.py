"""The README stays short and the documentation's links lead somewhere (issue 30)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_read_in_ten_minutes() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)


def test_the_readme_points_only_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text


def test_every_relative_link_in_the_docs_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


#: Work-diary phrases and private paths the user docs carried (issue 43 item 21): the dated
#: evidence lives in docs/results.md, the pages a user reads say what is true now.
DIARY = re.compile(r"once saw|seen in the first run of this|took \d+ min \d+ s on a clean clone"
                   r"|A fresh machine, measured|/work/|\.\./shared/")


def test_the_user_docs_carry_no_work_diary_or_private_path() -> None:
    pages = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "results.md")]
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if DIARY.search(line)]
    assert not found, found


def test_the_results_carry_no_private_path() -> None:
    assert "/work/" not in (ROOT / "docs" / "results.md").read_text()


ANCHORED = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page: each heading's slug (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``, a repeat gets ``-1``, ``-2`` ...), and explicit ``<a id>``s."""
    anchors: set[str] = set(EXPLICIT.findall(text))
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        found = None if fenced else HEADING.match(line)
        if found is None:
            continue
        title = re.sub(r"`|\*\*|<[^>]+>", "", found.group(1))
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_anchor_a_doc_links_to_is_a_heading_of_its_page() -> None:
    """A renamed heading broke links silently (``stacks.md`` to an ``fsdp.md`` section that had
    moved): the link check looked at the file only."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    anchors = {page.resolve(): github_anchors(page.read_text()) for page in pages}
    broken = []
    for page in pages:
        for target, anchor in ANCHORED.findall(page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target).resolve() if target else page.resolve()
            if linked.suffix == ".md" and linked in anchors and anchor not in anchors[linked]:
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


def test_the_anchor_rule_is_githubs() -> None:
    text = "# Step time: the model\n## `tp` and **pp** (v2)\n## Step time: the model\n<a id=\"kept\"></a>\n"
    assert github_anchors(text) == {"step-time-the-model", "tp-and-pp-v2", "step-time-the-model-1", "kept"}
