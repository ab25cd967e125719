"""The documentation holds: the dump-format example runs as printed and prints what the page
says; every document the project names exists; nothing cites texts outside the repository."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DUMP_FORMAT = ROOT / "docs" / "dump-format.md"


def test_dump_format_example_runs_and_prints_what_the_page_says(tmp_path, monkeypatch):
    text = DUMP_FORMAT.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    printed = re.search(r"It prints:\n\n```\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DUMP_FORMAT), "exec"), {"__name__": "dump_format_example"})
    assert out.getvalue() == printed
    assert (tmp_path / "step-4.npz").exists()


def test_every_named_document_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    named = set()
    for name in tracked:
        if name.endswith((".md", ".py", ".cu", ".cuh", ".sh", ".toml")):
            text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
            for match in re.findall(r"(?<![\w/.])((?:docs|benchmarks)/[\w.-]+\.md)", text):
                named.add((name, match))
            for match in re.findall(r"\]\(([\w.-]+\.md)\)", text):   # relative links
                named.add((name, str(Path(name).parent / match)))
    missing = sorted((where, doc) for where, doc in named if not (ROOT / doc).exists())
    assert not missing, missing


def test_citations_point_inside_the_repository():
    found = subprocess.run(["git", "grep", "-n", "-I", "-E", r"DESIGN\.md|spec §", "--", "."],
                           cwd=ROOT, capture_output=True, text=True).stdout
    lines = [line for line in found.splitlines() if not line.startswith("tests/docs/test_docs.py")]
    assert not lines, "\n".join(lines)


def test_format_sections_cited_in_code_exist():
    sections = set(re.findall(r"^## §(\d+) ", (ROOT / "docs" / "format.md").read_text(
        encoding="utf-8"), re.M))
    found = subprocess.run(["git", "grep", "-h", "-o", "-I", "-E", r"docs/format\.md §[0-9]+"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    cited = set(re.findall(r"§(\d+)", found))
    assert cited and cited <= sections, sorted(cited - sections)


def test_readme_cli_doc_and_benchmarks_quote_one_audit_time():
    def seconds(doc: str, pattern: str) -> str:
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
        found = re.findall(pattern, text)
        assert len(found) == 1, (doc, found)
        return found[0]

    quoted = {doc: seconds(doc, r"0\.96 GiB dump[^;]*?\b(?:in|takes) ([\d.]+) s\b")
              for doc in ("README.md", "docs/cli.md", "benchmarks/README.md")}
    assert len(set(quoted.values())) == 1, quoted


def test_the_docs_index_lists_every_page_and_the_readme_links_it():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, sorted(pages - linked)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/README.md)" in readme and "(docs/architecture.md)" in readme


def test_the_command_list_of_cli_md_names_every_command():
    from kvcanary.cli.main import main

    block = re.search(r"```\n(kvcanary .*?)```", (ROOT / "docs" / "cli.md").read_text(
        encoding="utf-8"), re.S).group(1)
    listed = set(re.findall(r"^kvcanary (\w+)", block, re.M))
    assert listed == set(main.commands), sorted(set(main.commands) ^ listed)


def test_install_lines_say_the_cpu_torch_first_and_one_install_for_every_extra():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    engines = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    for text in (readme, engines):
        flat = " ".join(text.split())
        at = flat.index("[transformers]'")
        assert "install torch's CPU build first" in flat[at:at + 400]
        assert "`pip install 'torch==2.13.0+cpu'`" in flat
        assert "replaces an editable install" in flat
    assert "pip install '.[transformers]'" in engines   # the README's spelling, too
