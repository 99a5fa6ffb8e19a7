"""Sections of the project's docs, copied into a report so that its links still work
once the page is mailed, attached to an issue or opened on another machine.

A report used to link to ``file://`` paths of the checkout that wrote it: dead links
anywhere else. Instead, each docs reference a report makes (``docs/NAME.md#anchor``)
becomes an in-page link to an appendix holding that section's text, taken from the
docs folder at render time. Without a docs folder (kvmetrics installed from a wheel)
the reference is shown as text, never as a link that goes nowhere. The appendix is
rendered here too, every line escaped through :mod:`kvmetrics.lab.markup`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvmetrics.lab.markup import Markup, html, join

#: Where the docs live in a checkout: next to the package.
DOCS_DIR = Path(__file__).resolve().parent.parent.parent / "docs"
#: A docs reference a run writes; anything else (from an edited file) is never resolved.
DOCS_REFERENCE = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")
#: A section longer than this is cut, with a note of where the rest is.
MAX_SECTION_CHARS = 6000


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@dataclass(frozen=True)
class DocSection:
    reference: str
    title: str
    text: str

    @property
    def element_id(self) -> str:
        """The appendix element's id: the reference made a valid, readable HTML id."""
        return "doc-" + re.sub(r"[^\w-]+", "-", self.reference.removeprefix("docs/")).strip("-")


def read_section(reference: str, docs_dir: Path = DOCS_DIR) -> DocSection | None:
    """The section a reference names (the file's opening, up to its first sub-heading,
    when it names no anchor), or None when the file or the anchor is not there."""
    match = DOCS_REFERENCE.fullmatch(reference)
    if match is None:
        return None
    name, anchor = match.groups()
    try:
        lines = (docs_dir / name).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    levels = _heading_levels(lines)
    if anchor is None:
        start, level = 0, 1
    else:
        found = next((i for i, line in enumerate(lines) if _names(line, levels[i], anchor)),
                     None)
        if found is None:
            return None
        start = found
        level = levels[start] or 6  # an <a id> line: up to the next heading of any level
    end = next((i for i in range(start + 1, len(lines)) if 0 < levels[i] <= level),
               len(lines))
    title = lines[start].lstrip("#").strip() if levels[start] else name
    body = "\n".join(lines[start + (1 if levels[start] else 0):end]).strip()
    if len(body) > MAX_SECTION_CHARS:
        body = body[:MAX_SECTION_CHARS].rsplit("\n", 1)[0] + f"\n\n[... continued in {reference}]"
    return DocSection(reference, title, body)


def _heading_levels(lines: list[str]) -> list[int]:
    """Each line's Markdown heading level (1-6), 0 for other lines and inside code."""
    levels, in_code = [], False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"(#{1,6}) ", line)
        levels.append(len(match[1]) if match else 0)
    return levels


def _names(line: str, level: int, anchor: str) -> bool:
    """Whether the line is the heading, or holds the ``<a id>``, that ``anchor`` names."""
    if level and heading_anchor(line.lstrip("#")) == anchor:
        return True
    return any(found == anchor for found in re.findall(r'<a id="([\w-]+)"', line))


@dataclass
class DocAppendix:
    """The sections one report links to, collected while the page is built."""

    docs_dir: Path = DOCS_DIR
    sections: dict[str, DocSection] = field(default_factory=dict)

    def resolve(self, reference: str) -> DocSection | None:
        section = self.sections.get(reference)
        if section is None:
            section = read_section(reference, self.docs_dir)
            if section is not None:
                self.sections[reference] = section
        return section


def _doc_text(text: str) -> Markup:
    """A docs section's Markdown as paragraphs and code blocks, every line escaped (no
    Markdown is interpreted: the text reads as in the file, wrapped by the browser)."""
    parts: list[Markup] = []
    lines: list[str] = []
    in_code = False

    def flush() -> None:
        if lines:
            parts.append(html("<pre>{}</pre>", join(lines, "\n")) if in_code
                         else html("<p>{}</p>", " ".join(lines)))
            lines.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            in_code = not in_code
        elif in_code:
            lines.append(line)
        elif not line.strip() or line.startswith(("#", "|", "- ")):
            flush()  # a blank line, heading, table row or list item starts anew
            if line.strip():
                lines.append(line)
        else:
            lines.append(line.strip())
    flush()
    return join(parts)


def render_appendix(appendix: DocAppendix, version: str) -> Markup:
    """The report's "Explanations": every section it linked to, escaped."""
    if not appendix.sections:
        return Markup("")
    parts = join(html('<section class="doc" id="{}"><h3>{}</h3><p class="src">{}, kvmetrics '
                      '{}</p><div class="doctext">{}</div></section>', s.element_id, s.title,
                      s.reference, version, _doc_text(s.text))
                 for s in appendix.sections.values())
    return html('<h2 id="explanations">Explanations</h2><p class="meta">The sections of '
                "kvmetrics' documentation this report links to, copied in so that the page "
                "stands alone.</p>{}", parts)
