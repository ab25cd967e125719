"""The help a newcomer reads: every option of every command says what it does, and the
command list of ``kvcanary --help`` shows whole phrases, never one cut mid-parenthesis."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kvcanary.cli.main import main


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_option_has_help(name):
    command = main.commands[name]
    bare = [p.name for p in command.params
            if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not bare, f"kvcanary {name}: options without help: {bare}"


def test_the_command_list_shows_whole_phrases():
    out = CliRunner().invoke(main, ["--help"], terminal_width=200).output
    listing = out.split("Commands:")[1]
    for name in main.commands:
        line = next(line for line in listing.splitlines() if line.strip().startswith(name))
        summary = line.strip()[len(name):].strip()
        assert summary.endswith(".") and "..." not in summary, line
        assert summary.count("(") == summary.count(")"), line


def test_help_names_no_file_an_installed_package_lacks():
    """An installed kvcanary has no benchmarks/, scripts/, tests/ or docs/ folder next to it."""
    import re

    for name, command in main.commands.items():
        text = " ".join((p.help or "") for p in command.params if isinstance(p, click.Option))
        text += command.help or ""
        assert not re.search(r"\b(benchmarks|scripts|tests|docs)/", text), name
