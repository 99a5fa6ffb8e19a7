"""The README and the docs say only what is true of this checkout.

Every ``kvmetrics`` command in the README's code blocks is parsed by the real
command line (an option renamed or dropped fails here, not in a newcomer's
terminal), the quick start's scripts exist, and every relative link in the README
and in ``docs/`` reaches a file, and a heading where the link names one. The
commands' behaviour is proven elsewhere: the default run (tests/test_lab_runs.py),
the soak's replay lines and ``--explain`` (tests/test_lab_soak.py), the demo
server (tests/test_demo.py), ``vllm-check`` (tests/test_vllm_check.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvmetrics.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _code_blocks(text: str) -> list[str]:
    """Shell (or unlabelled) fenced blocks; fences paired line by line, so a block in
    another language never shifts the pairing."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
            if lang in ("", "bash", "sh")]


def _kvmetrics_commands(*paths: Path) -> list[str]:
    """The ``kvmetrics`` command lines of the files' shell blocks (README by default)."""
    commands = []
    for path in paths or (README,):
        for block in _code_blocks(path.read_text(encoding="utf-8")):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split("  #", 1)[0].strip()
                for part in line.split("&&"):
                    part = re.split(r" [>|] ", part.strip())[0]  # output redirected or piped
                    if part.startswith(("kvmetrics ", ".venv/bin/kvmetrics")):
                        commands.append(part)
    return commands


def test_readme_is_short_enough_to_finish() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


def test_readme_has_kvmetrics_commands() -> None:
    assert len(_kvmetrics_commands()) >= 8


@pytest.mark.parametrize("command", _kvmetrics_commands() + _kvmetrics_commands(*DOCS))
def test_every_readme_and_docs_command_parses(command: str) -> None:
    # Placeholders and loop variables as a reader fills them in.
    argv = shlex.split(command.replace("SEED", "43").replace("$i", "0"))[1:]
    args = build_parser().parse_args(argv)  # SystemExit(2) on an unknown option
    assert getattr(args, "handler", None) is not None, command


def test_quick_start_scripts_exist() -> None:
    text = README.read_text(encoding="utf-8")
    for script in re.findall(r"bash (scripts/[\w.-]+\.sh)", text):
        assert (ROOT / script).is_file(), script


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links(path: Path) -> list[tuple[str, str]]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [(target, anchor) for target, anchor in
            re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_heading(path: Path) -> None:
    broken = []
    for target, anchor in _links(path):
        dest = (path.parent / target).resolve() if target else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
            continue
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{target}#{anchor} (no such heading)")
    assert broken == [], f"{path.name}: {broken}"


def test_no_tracked_file_reads_outside_the_checkout() -> None:
    """Users clone the repository alone: no script, test, doc or code may name a sibling
    folder of the checkout (the light vLLM pins and the trace once lived in one)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    sibling = re.compile(r"\.\./shared\b|parent\s*/\s*[\"']shared[\"']|REPO\.parent|ROOT\.parent")
    offenders = []
    for name in filter(None, listed):
        path = ROOT / name
        if path.suffix in {".jsonl", ".png"} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1)
                      if sibling.search(line)]
    assert not offenders, offenders


def test_shipped_trace_has_its_licence_beside_it() -> None:
    traces = ROOT / "data" / "traces"
    assert (traces / "mooncake_conversation_trace.jsonl").is_file()
    assert "Apache License" in (traces / "LICENSE-MOONCAKE").read_text(encoding="utf-8")
    assert "LICENSE-MOONCAKE" in (traces / "README.md").read_text(encoding="utf-8")


def test_the_vllm_install_hint_names_a_command_and_a_section_that_exist() -> None:
    from kvmetrics.lab.config import VLLM_INSTALL_HINT
    script, doc, anchor = re.search(r"bash (scripts/[\w.-]+) .*\((docs/[\w.-]+)#([\w-]+)\)",
                                    VLLM_INSTALL_HINT).groups()
    assert (ROOT / script).is_file()
    headings = re.findall(r"^#+ (.*)$", (ROOT / doc).read_text(encoding="utf-8"), flags=re.M)
    assert anchor in {_anchor(h) for h in headings}, (anchor, headings)


def test_the_docs_index_lists_every_doc() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert {p.name for p in DOCS} - {"README.md"} <= linked
