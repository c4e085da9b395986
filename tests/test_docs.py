"""The repository speaks to its users: no process vocabulary (a session, an issue or a run cited
by its number) in the README, the docs, the code, the tests, the scripts or the examples; the README and the
benchmarks stay short; every relative link in the README and the docs leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROCESS_WORDS = re.compile(r"session [0-9]|issue [0-9]|runs? [0-9]{2,}", re.IGNORECASE)


def _texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder, pattern in (("tiered", "*.py"), ("tests", "*.py"), ("scripts", "*"), ("examples", "*.py"),
                            ("configs", "*.yaml")):
        files += [p for p in sorted((ROOT / folder).rglob(pattern)) if p.is_file() and "__pycache__" not in p.parts]
    return files


def test_the_finder_finds_process_words():
    samples = [f"as in {'session'} 12", f"{'issue'} 4 says", f"GPU {'run'} 335", f"{'runs'} 51-53"]
    hits = [s for s in samples if PROCESS_WORDS.search(s)]
    assert len(hits) == 4
    assert not PROCESS_WORDS.search("a run of rows; 3 runs; issue: none")


def test_no_process_vocabulary():
    found = []
    for path in _texts():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if PROCESS_WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "cite the docs section and date instead:\n" + "\n".join(found)


@pytest.mark.parametrize("name, limit", [("README.md", 250), ("docs/benchmarks.md", 800)])
def test_short_enough(name, limit):
    assert len((ROOT / name).read_text().splitlines()) <= limit


def test_relative_links_lead_to_files():
    broken = []
    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_readme_anchors_exist():
    # links into another doc's section name a heading it has
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for file, anchor in re.findall(r"\]\(([^)\s#]*\.md)#([^)\s]+)\)", doc.read_text()):
            target = (doc.parent / file).read_text()
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", target, re.M)}
            if anchor not in slugs:
                missing.append(f"{doc.relative_to(ROOT)} -> {file}#{anchor}")
    assert not missing, "\n".join(missing)
