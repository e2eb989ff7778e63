"""The docs' local links resolve: every relative link and image in README.md, CONTRIBUTING.md, docs/*.md,
drafts/*/README.md and data/*/README.md names a file that exists, and a ``#anchor`` names a heading of the
page it points to. Every image under docs/img is shown by some page, so unused plots do not pile up, and the
pages' commands write their outputs to the ignored out/ or runs/, never over a tracked file."""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]

# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")
# Where a documented command writes: an output flag's value or a shell redirect's target.
OUTPUT = re.compile(r"(?:--out|--png|--table|--plot|--curve-plot|--curve-json|--benchmark-json)[= ]+([\w./-]+)"
                    r"|(?<![-=<>0-9&])>\s*([\w./-]+)")
TRACKED_DIRS = ("docs/", "drafts/", "data/", "python/", "bench/", "tests/", "scripts/", "csrc/", "poss_ext/",
                "examples/")


def doc_pages() -> List[Path]:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted(ROOT.glob("drafts/*/README.md")) + sorted(ROOT.glob("data/*/README.md"))
    return [p for p in pages if p.is_file()]


def prose_lines(text: str, keep_code: bool = False) -> List[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links there are examples)
    unless ``keep_code`` (headings keep their code spans' text in their anchors)."""
    out, fence = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            fence = None if fence == marker else (fence or marker)
            continue
        if fence is None:
            out.append(line if keep_code else re.sub(r"`[^`]*`", "``", line))
    return out


def links(text: str) -> List[str]:
    found = []
    for line in prose_lines(text):
        found += INLINE.findall(line) + HTML_SRC.findall(line)
        ref = REFERENCE.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def code_lines(text: str) -> List[str]:
    """The lines inside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = None if fence == marker else (fence or marker)
        elif fence is not None:
            out.append(line)
    return out


def tracked_outputs(text: str) -> List[str]:
    """Output paths of the page's commands that land in a tracked folder."""
    found = []
    for line in code_lines(text):
        for flag_target, redirect_target in OUTPUT.findall(line):
            target = (flag_target or redirect_target).lstrip("./")
            if target.startswith(TRACKED_DIRS):
                found.append(target)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for line in prose_lines(text, keep_code=True):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> List[Tuple[str, str]]:
    """(link, why) for each local link of ``page`` that does not resolve."""
    bad = []
    text = page.read_text(encoding="utf-8")
    for target in links(text):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if path_part and root.resolve() not in (dest, *dest.parents):
            bad.append((target, "points outside the repository"))
            continue
        if not dest.exists():
            bad.append((target, "no such file"))
            continue
        if anchor and dest.is_file() and dest.suffix == ".md":
            if anchor.lower() not in anchors(dest.read_text(encoding="utf-8")):
                bad.append((target, f"no heading #{anchor} in {dest.name}"))
    return bad


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_write_to_ignored_folders(page):
    assert tracked_outputs(page.read_text(encoding="utf-8")) == []


def test_the_output_check_finds_tracked_targets():
    text = ("```bash\npython bench/x.py --out docs/bench/x.json --png out/x.png 2>&1\n"
            "python scripts/p.py > docs/bench/p.md\npython a.py --table=out/t.md -> runs/r\n```\n"
            "--out docs/outside-a-fence.json\n")
    assert tracked_outputs(text) == ["docs/bench/x.json", "docs/bench/p.md"]


def test_example_docstrings_cite_sections_that_exist():
    """examples/*.py say where the docs show them as ``(PAGE § HEADING)``; the page and heading exist."""
    cited = 0
    for example in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(example.read_text(encoding="utf-8"))) or ""
        refs = re.findall(r"\(([\w./-]+\.md) § ([^;)]+(?:\([^)]*\)[^;)]*)*)", " ".join(doc.split()))
        assert refs, f"{example.name}: its docstring should name the page and section that show it"
        for page, heading in refs:
            path = ROOT / page
            assert path.is_file(), f"{example.name} cites {page}"
            headings = anchors(path.read_text(encoding="utf-8"))
            assert slug(heading) in headings, f"{example.name} cites {page} § {heading}"
            cited += 1
    assert cited >= 3


def test_the_pages_are_found():
    names = {str(p.relative_to(ROOT)) for p in doc_pages()}
    assert {"README.md", "CONTRIBUTING.md", "docs/benchmarks.md"} <= names
    assert any(n.startswith("drafts/") for n in names) and any(n.startswith("data/") for n in names)


def test_every_image_is_shown_somewhere():
    shown = set()
    for page in doc_pages():
        for target in links(page.read_text(encoding="utf-8")):
            if not target.startswith(EXTERNAL):
                shown.add((page.parent / target.partition("#")[0]).resolve())
    images = sorted(p for p in (ROOT / "docs" / "img").glob("*") if p.is_file())
    assert [str(p.relative_to(ROOT)) for p in images if p.resolve() not in shown] == []


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# A page\n\n## Two words: `code`\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/there.md) [anchor ok](docs/there.md#two-words-code) [web](https://example.org/x)\n"
        "![gone](docs/img/gone.png) [missing](docs/missing.md) [bad anchor](docs/there.md#nowhere)\n"
        "[self](#a-readme) `[in code](nothing.md)`\n"
        "```\n[in a fence](nothing.md)\n```\n"
        "[ref]: docs/also-missing.md\n"
        "# A README\n")
    assert broken_links(page, tmp_path) == [
        ("docs/img/gone.png", "no such file"),
        ("docs/missing.md", "no such file"),
        ("docs/there.md#nowhere", "no heading #nowhere in there.md"),
        ("docs/also-missing.md", "no such file"),
    ]
