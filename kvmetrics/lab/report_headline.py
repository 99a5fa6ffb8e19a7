"""The top of the run report: the verdict, the headline tiles and the findings' cards.

These are what a person reads first, often without the docs at hand, so every figure
carries its label and, where two figures look as if they disagree (1.4% failed next to
2.0% injected, more tokens recomputed than rolled back), the sentence that says why.
Command-line options in the text are kept whole when the page wraps (``--fault-rate
0.1`` never breaks after its first hyphen). All markup is built by
:mod:`kvmetrics.lab.markup`, which escapes every value.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from kvmetrics.lab.doc_sections import DocAppendix
from kvmetrics.lab.markup import Markup, html, join
from kvmetrics.lab.verdict import FAIL, PASS, faults_text, recompute_note, verdict

#: An option as it appears in running text, with its value when one follows: the unit
#: that must not be split over two lines.
#: A value longer than this (a file path) may break, or it would run out of its box.
OPTION = re.compile(r"--[a-z][\w-]*(?: (?!--)[^\s,;:()]{1,24}(?![^\s,;:()]))?")
#: A command-line group longer than this (a long path) may break inside.
LONGEST_UNBROKEN = 60

#: The verdict banner's class for each status (anything else: neutral).
VERDICT_CLASSES = {PASS: "pass", FAIL: "fail"}


def with_options(text: str) -> Markup:
    """``text`` escaped, with each option (and its value) in a span that does not wrap."""
    parts: list[Any] = []
    last = 0
    for match in OPTION.finditer(text):
        parts.append(text[last:match.start()])
        parts.append(html('<span class="opt">{}</span>', match.group(0)))
        last = match.end()
    parts.append(text[last:])
    return join(parts)


def command_markup(argv: list[str]) -> Markup:
    """A command line whose lines break only between options: each ``--flag value``
    (and the leading ``kvmetrics run``) is one unbreakable group."""
    groups: list[list[str]] = []
    for arg in argv:
        if not groups or arg.startswith("--"):
            groups.append([])
        groups[-1].append(shlex.quote(arg))
    shown = (" ".join(g) for g in groups)
    return join((html('<span class="arg">{}</span>', text) if len(text) <= LONGEST_UNBROKEN
                 else text for text in shown), " ")


def link(target: str, text: str, appendix: DocAppendix) -> Markup:
    """A docs reference (``docs/vllm-defects.md#anchor``) as a link to its section,
    copied into the page's appendix; as text when the section cannot be had."""
    section = appendix.resolve(target.split(" ", 1)[0])
    if section is None:
        return html("<code>{}</code>", target)
    return html('<a href="#{}">{}</a>', section.element_id, text)


def verdict_banner(doc: dict[str, Any]) -> Markup:
    """PASS, FAIL or NOT VERIFIED and why, over the faults and the recovery it ran under."""
    judged = verdict(doc)
    config = doc.get("config") or {}
    under = ""
    if config:
        under = html('<span class="under">faults: {} &middot; {} &middot; {}</span>',
                     with_options(faults_text(config)),
                     with_options(f"--policy {config.get('policy')}"),
                     with_options(f"--recovery {config.get('recovery')}"))
    return html('<div class="verdict {cls}" id="verdict"><b>{status}</b> &mdash; {reason}{under}'
                "</div>", cls=VERDICT_CLASSES.get(judged.status, "neutral"),
                status=judged.status, reason=judged.reason, under=under)


def _failed_share_tile(doc: dict[str, Any]) -> tuple[Markup, Markup, str]:
    k = doc["kv_load"]
    loaded = k["blocks_ok"] + k["blocks_failed"]
    share = k["blocks_failed"] / loaded if loaded else 0.0
    config = doc.get("config") or {}
    injected = bool(config.get("fault_plan")) or bool(config.get("fault_rate"))
    measured = html("of loaded KV blocks failed in this run ({failed:,} of {loaded:,})",
                    failed=k["blocks_failed"], loaded=loaded)
    if config.get("fault_plan"):
        plan = html("injected: as the fault plan lists them ({})",
                    with_options(f"--fault-plan {config['fault_plan']}"))
    elif config.get("fault_rate"):
        rate = config["fault_rate"]
        plan = html("injected rate: {:.1%} per block ({}); the measured share varies "
                    "around it", rate, with_options(f"--fault-rate {rate:g}"))
    else:
        plan = Markup("no faults were injected")
    # Failures the run injected on purpose are its input, not an alarm: red only where
    # nothing was injected.
    return (html("{:.1%}", share), html("{}<br>{}", measured, plan),
            "bad" if k["blocks_failed"] and not injected else "")


def _tokens_tile(doc: dict[str, Any]) -> tuple[Markup, Markup, str]:
    rolled, again = doc["rolled_back_tokens"], doc["recomputed_tokens"]["kv_load_failure"]
    # Two counts side by side, no slash between: "960 / 1,445" reads as a fraction.
    value = html('<span class="nw">{:,} <small>rolled back</small></span> '
                 '<span class="nw">{:,} <small>recomputed</small></span>', rolled, again)
    label = Markup("tokens after failed loads: rolled back, taken back by the recovery "
                   "path; recomputed, computed again")
    if recompute_note(doc):
        label = html("{}<br>{}", label, "recomputed also counts each failed step's own "
                     "discarded tokens, and counts again after a preemption")
    return value, label, ""


def tiles(doc: dict[str, Any]) -> Markup:
    """The headline figures, each labelled in full."""
    r = doc["requests"]
    stale = doc["verification"]["failed_blocks"]
    verified = doc["verification"]["verified_tokens"]
    all_tiles = [
        (html("{:,}", r["submitted"]),
         html("requests: {:,} finished, {:,} failed, {:,} aborted", r["finished"],
              r["failed"], r["aborted"]), ""),
        _failed_share_tile(doc),
        (html("{:,}", doc["kv_load"]["failed_requests"]),
         Markup("requests hit by a failed load"), ""),
        _tokens_tile(doc),
        (html("{:,}", stale) if verified else Markup("not verified"),
         Markup("stale KV block reads (verifier)") if verified
         else html("stale reads: run with {}", with_options("--verify full")),
         "bad" if stale else ("good" if verified else "")),
    ]
    return html('<div class="tiles">{}</div>', join(
        html('<div class="tile {}"><div class="v">{}</div><div class="l">{}</div></div>',
             cls, value, label) for value, label, cls in all_tiles))


def _cause_card(c: dict[str, Any], base: DocAppendix) -> Markup:
    links = []
    if c.get("docs"):
        links.append(html("why: {}", link(c["docs"], c["docs"].split("#")[-1], base)))
    if c.get("avoid"):
        links.append(html("avoid it with {}", link("docs/lab.md#the-command-line",
                                                   c["avoid"], base)))
    return html(
        '<div class="card" data-cause="{cause}"><h4>Stale KV: {title}{unknown}</h4>'
        '<div class="n">{failed:,} block reads by {requests:,} request(s) in {blocks:,} '
        "block(s), from step {first}</div><p>{explanation}</p>"
        '<p class="eg">e.g. {example}</p><p>{links}</p></div>',
        cause=c["cause"], title=c["cause"].replace("_", " "),
        unknown="" if c["known"] else " (cause unknown)", failed=c["failed_blocks"],
        requests=c["requests"], blocks=c["blocks"],
        first="-" if c["first_step"] is None else c["first_step"],
        explanation=c["explanation"], example=c["example"],
        links=join(links, " &middot; "))


def _violation_card(v: dict[str, Any], base: DocAppendix) -> Markup:
    if v["kind"] == "invariant":
        what = f"invariant {v['invariant']} broken ({v['metric']})"
    else:
        what = f"{v['reason'].replace('_', '-')} increments of {v['metric']} rejected"
    who = html(", first request {}", v["first_request"]) if v["first_request"] else ""
    return html(
        '<div class="card violation"><h4>{what}</h4><div class="n">{count:,} time(s), '
        'first at step {first}{who}</div><p class="eg">e.g. {example}</p><p>{docs}</p>'
        "</div>", what=what, count=v["count"], first=v["first_step"], who=who,
        example=v["examples"][0] if v["examples"] else "",
        docs=link("docs/metrics.md", "what the guard and the invariants check", base))


def cards(doc: dict[str, Any], base: DocAppendix) -> Markup:
    """One card per cause of stale reads and per group of violations; a clean run says
    so in one line."""
    findings = doc.get("findings") or {}
    shown = [_cause_card(c, base) for c in findings.get("causes") or ()]
    shown += [_violation_card(v, base) for v in doc.get("violations") or ()]
    if not shown:
        return Markup('<div class="clean">No stale KV read, no guard rejection, no invariant '
                      "violation.</div>")
    return html('<div class="cards">{}</div>', join(shown))
