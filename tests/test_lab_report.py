"""The run report: the HTML page renders in a real browser, offline, with its charts.

The browser is Debian's Chromium, headless, with every network path closed (a dead
proxy and a resolver that finds nothing), so a page that tried to fetch anything
would be missing it. The screenshot is checked by its pixels: not blank, and the
ink of each chart's series colours is there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from kvmetrics.lab.report import COLOURS
from kvmetrics.lab.timeline import TimelineSink
from kvmetrics.metrics import catalogue as cat
from tests.lab_support import run_cli

pytestmark = pytest.mark.browser

#: Seed 66's soak scenario as `kvmetrics run` options: policy recompute, mixed loads,
#: preemption and aborts; vLLM's recovery path lets requests read stale KV.
# Admission on the first chunk (vLLM's gate on the whole prompt off): more preemption,
# so vLLM's recovery path reads stale KV in this run.
STALE = ("--workload", "rag", "--max-requests", "35", "--block-size", "4",
         "--num-gpu-blocks", "514", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
         "--fault-rate", "0.2", "--fault-mode", "mixed", "--store-blocks", "1024",
         "--abort-rate", "0.1", "--seed", "66", "--no-reserve-full-prompt")
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                 # Nothing may be fetched: any request would fail.
                 "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
                 "--enable-logging=stderr", "--v=0")


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, "chromium not found: `bash scripts/install.sh --test` installs it (apt)"
    return path


def browse(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", *args,
                           page.as_uri()], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    out = tmp_path_factory.mktemp("report")
    page, doc = out / "run.html", out / "run.json"
    result = run_cli("run", *STALE, "--report", str(page), "--output", str(doc))
    assert result.returncode == 3, result.stderr  # stale reads found
    return page, doc, json.loads(doc.read_text())


def test_report_is_self_contained(stale_run: tuple[Path, Path, dict]) -> None:
    page, _, _ = stale_run
    text = page.read_text()
    # Nothing the browser would fetch (the copied docs may mention a URL as text).
    assert not re.search(r'(?:href|src|action)="[a-z]+:|url\((?!#)', text)
    assert "<script" not in text and "@import" not in text
    assert not re.search(r'\bsrc="', text)  # nothing embedded by reference
    # Links only within the page: the docs sections it cites are copied in, so the
    # links still work once the page is sent elsewhere (no file:// into a checkout).
    targets = re.findall(r'\bhref="([^"]*)"', text)
    assert targets
    for target in targets:
        assert target.startswith("#") and f'id="{target[1:]}"' in text, target
    assert text.count("<svg") == 8  # this run moves every chart's series
    assert len(text) < 2_000_000


def test_report_renders_in_chromium_with_its_charts(stale_run: tuple[Path, Path, dict],
                                                    tmp_path: Path) -> None:
    page, _, doc = stale_run
    shot = tmp_path / "shot.png"
    result = browse(page, tmp_path / "profile", "--window-size=1320,2600",
                    f"--screenshot={shot}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not re.search(r"CONSOLE|Uncaught|net::ERR_", result.stderr), result.stderr[-3000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1320, 2600)
    colours = image.getcolors(maxcolors=1 << 24)
    ink = sum(n for n, p in colours if sum(p) < 720)  # anything clearly not white
    assert ink > 0.03 * image.width * image.height, "the page looks blank"
    assert len(colours) > 100, "a page with charts has many colours"
    counts = _colour_counts(image)
    for name in ("local", "external", "ok", "failed", "rolled_back", "capacity", "usage",
                 "running", "waiting", "preemptions"):
        assert counts[COLOURS[name]] >= 40, (name, counts)
    # The run found stale reads: the report says what and why.
    assert doc["findings"]["failed_blocks"] > 0
    dom = browse(page, tmp_path / "profile2", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert dom.stdout.count("<svg") == 8
    # Headline tiles first, then the finding as a card with working links.
    assert dom.stdout.index('class="tiles"') < dom.stdout.index('id="findings"')
    card = re.search(r'<div class="card" data-cause="(\w+)">.*?</div></div>', dom.stdout, re.S)
    assert card and card.group(1) in {c["cause"] for c in doc["findings"]["causes"]}
    links = re.findall(r'href="([^"]+)">([^<]+)</a>', card.group(0))
    assert [text for _, text in links] == ["recompute-keeps-failed-block", "--recovery evict"]
    cause = next(c for c in doc["findings"]["causes"] if c["cause"] == card.group(1))
    wanted = {cause["docs"].partition("#")[2], "the-command-line"}
    for target, _ in links:  # each link reaches the docs section it names, in the page
        section = re.search(rf'<section class="doc" id="{re.escape(target[1:])}"><h3>(.*?)'
                            r'</h3>.*?<div class="doctext">(.+?)</div></section>',
                            dom.stdout, re.S)
        assert section, target
        assert _slug(re.sub(r"<[^>]+>", "", section[1])) in wanted, section[1]
        assert len(section[2]) > 200, section[2]


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_injected_failures_and_switches_are_shown_as_configured(
        stale_run: tuple[Path, Path, dict], tmp_path: Path) -> None:
    from kvmetrics.lab.report import render_report

    page, _, doc = stale_run
    text = page.read_text()
    # The failures were asked for: the tile says so, the measured share labelled as
    # such next to the injected rate, and is not red.
    tile = _failed_share_tile(text)
    assert tile and tile[1] == "", tile and tile[0]
    k = doc["kv_load"]
    assert tile[2] == f"{k['blocks_failed'] / (k['blocks_ok'] + k['blocks_failed']):.1%}"
    assert tile[3] == f"{k['blocks_failed']:,} of {k['blocks_ok'] + k['blocks_failed']:,}"
    assert ('injected rate: 20.0% per block (<span class="opt">--fault-rate 0.2</span>); '
            "the measured share varies around it") in tile[0]
    # A switch shows whether it was given, not the setting behind it.
    assert "<th>--no-reserve-full-prompt</th><td>given</td>" in text
    # Settings outside the replay line are shown as the options that set them.
    assert "<h3>watching the run (not replayed)</h3>" in text
    assert "<th>--strict</th><td>not given</td>" in text
    options = set(re.findall(r"--[a-z-]+", run_cli("run", "--help").stdout))
    shown = set(re.findall(r"<th>([^<]*)</th><td>", text.split('<div class="config">')[1]))
    assert shown <= options, shown - options
    assert "<th>--async-scheduling</th><td>not given</td>" in text
    doc["config"]["reserve_full_prompt"] = True
    doc["config"]["fault_rate"] = 0.0
    again = render_report(doc)
    assert "<th>--no-reserve-full-prompt</th><td>not given</td>" in again
    tile = _failed_share_tile(again)
    assert tile[1] == "bad" and "no faults were injected" in tile[0]


def _failed_share_tile(page: str) -> re.Match[str] | None:
    """The tile of failed loads: (whole tile, its class, the share, "failed of loaded")."""
    return re.search(r'<div class="tile ([^"]*)"><div class="v">([^<]*)</div><div class="l">'
                     r"of loaded KV blocks failed in this run \(([\d,]+ of [\d,]+)\)<br>"
                     r".*?</div></div>", page)


def test_the_verdict_and_every_headline_figure_are_labelled(
        stale_run: tuple[Path, Path, dict]) -> None:
    page, _, doc = stale_run
    text = page.read_text()
    stale, readers = doc["verification"]["failed_blocks"], doc["findings"]["requests"]
    # The verdict first, with the faults and the recovery it ran under.
    banner = re.search(r'<div class="verdict (\w+)" id="verdict">(.*?)</div>', text)
    assert banner and banner[1] == "fail", banner
    assert banner[2].startswith(f"<b>FAIL</b> &mdash; {stale:,} stale KV block reads by "
                                f"{readers:,} requests: ")
    assert ('faults: each loaded KV block fails with probability 20.0% (<span class="opt">'
            '--fault-rate 0.2</span>) &middot; <span class="opt">--policy recompute</span> '
            '&middot; <span class="opt">--recovery vllm</span>') in banner[2]
    assert text.index('id="verdict"') < text.index('class="tiles"')
    # Rolled back and recomputed: each number named, and why the second is larger.
    rolled, again = doc["rolled_back_tokens"], doc["recomputed_tokens"]["kv_load_failure"]
    assert again > rolled  # this run shows the case the label explains
    tile = re.search(r'<div class="v"><span class="nw">([\d,]+) <small>rolled back</small>'
                     r'</span> <span class="nw">([\d,]+) <small>recomputed</small></span>'
                     r'</div><div class="l">(.*?)</div>', text)
    assert tile and (tile[1], tile[2]) == (f"{rolled:,}", f"{again:,}"), tile
    assert tile[3] == ("tokens after failed loads: rolled back, taken back by the recovery "
                       "path; recomputed, computed again<br>recomputed also counts each "
                       "failed step&#x27;s own discarded tokens, and counts again after a "
                       "preemption")
    # The summary table marks the figure and says the same under it.
    assert f"<td>{again:,} after failed loads*, " in text
    assert (f'<p class="note">* {again:,} tokens recomputed after failed loads, more than the '
            f"{rolled:,} rolled back: ") in text


#: For each text run of the page that holds an option (an option and a short value, as
#: in running text), whether the browser laid it out over more than one line. Added to
#: a copy of the report only: the report itself has no script.
LINE_CHECK = """<script>
const option = /--[a-z][\\w-]*(?: (?!--)[^\\s,;:()]{1,24}(?![^\\s,;:()]))?/g;
const broken = [];
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
for (let node = walker.nextNode(); node; node = walker.nextNode()) {
  if (node.parentElement.closest('svg, .doc, script')) continue;
  for (const m of node.data.matchAll(option)) {
    const range = document.createRange();
    range.setStart(node, m.index);
    range.setEnd(node, m.index + m[0].length);
    const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
    if (tops.size > 1) broken.push(m[0]);
  }
}
const groups = [...document.querySelectorAll('.replay .arg')];
for (const g of groups) {
  if (new Set([...g.getClientRects()].map(r => Math.round(r.top))).size > 1)
    broken.push(g.textContent);
}
document.body.setAttribute('data-broken', JSON.stringify(broken));
document.body.setAttribute('data-args', String(groups.length));
</script>"""


@pytest.mark.parametrize("width", [700, 1280])
def test_no_option_breaks_over_two_lines(stale_run: tuple[Path, Path, dict], tmp_path: Path,
                                         width: int) -> None:
    """In the tiles, the verdict, the cards, the tables and the replay line, an option and
    its value stay on one line, at a laptop's width and a narrow one."""
    page, _, _ = stale_run
    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</body>", LINE_CHECK + "</body>"))
    dom = browse(checked, tmp_path / "profile", f"--window-size={width},2000", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    found = re.search(r'data-broken="([^"]*)" data-args="(\d+)"', dom.stdout)
    assert found, dom.stdout[-2000:]
    assert int(found[2]) > 10  # the replay line's options were found and measured
    assert json.loads(found[1].replace("&quot;", '"')) == []


def test_without_the_docs_a_reference_is_text_not_a_dead_link(
        stale_run: tuple[Path, Path, dict], tmp_path: Path) -> None:
    from kvmetrics.lab.report import render_report

    page = render_report(stale_run[2], docs_dir=tmp_path / "no-docs")
    assert "<a href=" not in page and "Explanations" not in page
    assert "<code>docs/vllm-defects.md#" in page


def test_clean_run_draws_nothing_empty(tmp_path: Path) -> None:
    doc = tmp_path / "clean.json"
    result = run_cli("run", "--verify", "off", "--max-requests", "30", "--fault-rate", "0",
                     "--store-blocks", "0", "--output", str(doc))
    assert result.returncode == 0, result.stderr
    from kvmetrics.lab.report import render_report

    page = render_report(json.loads(doc.read_text()))
    assert "Findings</h2>" in page and 'class="clean"' in page
    titles = re.findall(r"<text[^>]*>([A-Z][^<]+)</text>", page)
    # No faults, no store, no verifier: no findings, load or eviction-by-failure chart.
    assert not any(t.startswith(("Findings", "KV loads")) for t in titles), titles
    assert "red bands" not in page


def _colour_counts(image: Image.Image) -> dict[str, int]:
    """Pixels within a small distance of each report colour (antialiased lines keep
    their pure colour along the middle)."""
    wanted = {name: tuple(int(name[i:i + 2], 16) for i in (1, 3, 5))
              for name in set(COLOURS.values())}
    counts = dict.fromkeys(wanted, 0)
    for n, pixel in image.getcolors(maxcolors=1 << 24):
        for name, rgb in wanted.items():
            if sum(abs(a - b) for a, b in zip(pixel, rgb, strict=True)) <= 24:
                counts[name] += n
    return counts


def test_report_command_rebuilds_the_same_page(stale_run: tuple[Path, Path, dict],
                                               tmp_path: Path) -> None:
    page, doc, _ = stale_run
    again = tmp_path / "again.html"
    result = run_cli("report", str(doc), "-o", str(again))
    assert result.returncode == 0, result.stderr
    assert again.read_text() == page.read_text()


def test_report_refuses_a_document_without_timeline(tmp_path: Path) -> None:
    doc = tmp_path / "summary.json"
    doc.write_text(json.dumps({"engine": "reference"}))
    result = run_cli("report", str(doc))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvmetrics: error: {doc}: the run document has no timeline (write it with "
        "`kvmetrics run --output RUN.json`)"]


def test_report_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; from kvmetrics.cli.main import main;"
            f" sys.exit(main(['run', '--verify', 'off', '--max-requests', '3', '--report', "
            f"'{tmp_path / 'r.html'}']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvmetrics: error: the HTML report needs matplotlib: pip install 'kvmetrics[report]' "
        "(or rerun scripts/install.sh, which installs it)"]


def test_timeline_sums_match_the_summary(stale_run: tuple[Path, Path, dict]) -> None:
    _, _, doc = stale_run
    tl = doc["timeline"]
    c = tl["counters"]
    assert sum(c["load_blocks_failed"]) == doc["kv_load"]["blocks_failed"]
    assert sum(c["verification_failed_blocks"]) == doc["verification"]["failed_blocks"]
    assert sum(c["preemptions"]) == doc["preemptions"]
    assert sum(c["local_query_tokens"]) == doc["prefix_cache"]["local"]["query_tokens"]
    assert tl["last_step"][-1] == doc["steps"]


def test_bucketing_keeps_sums_against_a_brute_force_count() -> None:
    """3000 steps into at most 16 buckets: each bucket's sum equals the sum of the
    steps it covers, computed here directly from the input."""
    sink = TimelineSink(max_points=16)
    common = ("m", "0")
    amounts = {step: (step * 7919) % 13 for step in range(1, 3001)}
    for step in range(1, 3001):
        sink.inc(cat.PREEMPTIONS, common, amounts[step])
        sink.set(cat.KV_CACHE_USAGE, common, (step % 10) / 10)
        sink.close_step(step)
    data = sink.as_dict()
    assert len(data["last_step"]) <= 17 and data["bucket_steps"] == 256
    assert data["first_step"][0] == 1 and data["last_step"][-1] == 3000
    for first, last, got, usage in zip(data["first_step"], data["last_step"],
                                       data["counters"]["preemptions"],
                                       data["gauges"]["kv_cache_usage"], strict=True):
        steps = range(first, last + 1)
        assert got == sum(amounts[s] for s in steps)
        assert usage == pytest.approx(sum((s % 10) / 10 for s in steps) / len(steps), abs=1e-4)
    assert [b - a for a, b in zip(data["last_step"], data["first_step"][1:],
                                  strict=False)] == [1] * (len(data["last_step"]) - 1)


# -- hostile run files (issue 28, cases 7 and 18) ----------------------------------------

#: Markup that would run, load or reorder something if any field reached the page raw.
PAYLOAD = ("</p></div><script>document.body.setAttribute('data-pwned','1')</script>"
           "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">"
           "\u202egnp.exe\x1b[31m\n")
VIOLATION = {"kind": "guard_rejection", "metric": "kvmetrics_rolled_back_tokens_total",
             "reason": "negative", "count": 2, "first_step": 7, "first_request": "r-1",
             "examples": ["refused negative increment of kvmetrics_rolled_back_tokens_total "
                          "at step 7 request=r-1: amount -128"]}


def _with_violation(doc: dict) -> dict:
    return json.loads(json.dumps({**doc, "violations": [VIOLATION]}))


def _hostile_strings(value: object, key: str = "") -> object:
    """Every text value replaced by PAYLOAD, but a violation's kind (an enumeration)."""
    if isinstance(value, dict):
        return {k: _hostile_strings(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_hostile_strings(v, key) for v in value]
    if isinstance(value, str) and key != "kind":
        return PAYLOAD
    return value


@pytest.mark.parametrize("where", ["violations", "causes"])
def test_a_script_where_a_number_belongs_is_refused_in_one_line(
        stale_run: tuple[Path, Path, dict], tmp_path: Path, where: str) -> None:
    _, _, doc = stale_run
    doc = _with_violation(doc)
    if where == "violations":
        doc["violations"][0]["first_step"] = PAYLOAD
        field = "violations[0].first_step"
    else:
        doc["findings"]["causes"][0]["first_step"] = PAYLOAD
        field = "findings.causes[0].first_step"
    run = tmp_path / "run.json"
    run.write_text(json.dumps(doc))
    result = run_cli("report", str(run), "-o", str(tmp_path / "run.html"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvmetrics: error: {run}: field {field!r} must be an integer >= 0"]
    assert not (tmp_path / "run.html").exists()


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d["violations"][0]["examples"].append(3), "violations[0].examples[1]"),
    (lambda d: d["violations"][0].update(kind="other"), "violations[0].kind"),
    (lambda d: d["findings"]["causes"][0].update(known="yes"), "findings.causes[0].known"),
    (lambda d: d["timeline"]["counters"].update(x=["1"]), "timeline.counters.x[0]"),
    (lambda d: d["config"].update(seed="7"), "config.seed"),
    (lambda d: d["prefix_cache"]["local"].update(hit_ratio=float("nan")),
     "prefix_cache.local.hit_ratio"),
    (lambda d: d["requests"].update(submitted=10**5000), "requests.submitted"),
])
def test_every_field_of_the_run_file_is_type_checked(
        stale_run: tuple[Path, Path, dict], change: object, field: str) -> None:
    from kvmetrics.lab.report import ReportInputError, render_report

    doc = _with_violation(stale_run[2])
    change(doc)  # type: ignore[operator]
    with pytest.raises(ReportInputError, match=re.escape(repr(field))):
        render_report(doc)


def test_every_text_field_reaches_the_page_escaped(stale_run: tuple[Path, Path, dict],
                                                   tmp_path: Path) -> None:
    doc = _hostile_strings(_with_violation(stale_run[2]))
    assert isinstance(doc, dict)
    doc["config"]["an_unknown_setting"] = PAYLOAD  # a later version's field: shown as text
    run, page = tmp_path / "run.json", tmp_path / "run.html"
    run.write_text(json.dumps(doc))
    result = run_cli("report", str(run), "-o", str(page))
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert "<script" not in text and "<img" not in text
    assert "\u202e" not in text and "\x1b" not in text  # shown as \u202e, \x1b
    shown = ("&lt;/p&gt;&lt;/div&gt;&lt;script&gt;document.body.setAttribute(&#x27;"
             "data-pwned&#x27;,&#x27;1&#x27;)&lt;/script&gt;")
    assert text.count(shown) >= 8 and "\\u202egnp.exe\\x1b[31m\\n" in text
    dom = browse(page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert "data-pwned=" not in dom.stdout and "<script" not in dom.stdout
    assert "<img" not in dom.stdout
    cards = len(doc["findings"]["causes"]) + 1  # each cause and the violation: intact
    assert len(re.findall(r'<div class="card[ "]', dom.stdout)) == cards


def test_the_report_builds_its_html_only_through_the_escaping_helper() -> None:
    """No f-string or concatenation in the report's modules makes markup: a field added
    later goes through markup.html(), which escapes it, or it does not reach the page."""
    import ast

    import kvmetrics.lab.report as report
    import kvmetrics.lab.report_charts as charts
    import kvmetrics.lab.report_headline as headline

    for module in (report, charts, headline):
        _no_markup_outside_the_helper(ast.parse(Path(module.__file__).read_text()))


def _no_markup_outside_the_helper(tree: object) -> None:
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            assert "<" not in literal, f"line {node.lineno}: markup in an f-string"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
            for side in (node.left, node.right):
                assert not (isinstance(side, ast.Constant) and "<" in str(side.value)), \
                    f"line {node.lineno}: markup built by + or %"
