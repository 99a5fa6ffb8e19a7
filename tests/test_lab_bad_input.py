"""Bad input through the real console script: one line naming the problem, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.lab_support import run_cli

GOOD_LINE = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def _trace(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _assert_clean_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_trace(tmp_path: Path) -> None:
    _assert_clean_error(run_cli("run", "--trace", str(tmp_path / "nope.jsonl")),
                        "cannot read trace", "nope.jsonl")


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, [json.dumps(GOOD_LINE), "{not json"])
    _assert_clean_error(run_cli("run", "--trace", path, "--trace-format", "mooncake"),
                        "trace.jsonl:2", "bad JSON")


@pytest.mark.parametrize(("record", "needle"), [
    ({"timestamp": 0, "output_length": 4, "hash_ids": [1]}, "missing field 'input_length'"),
    ({**GOOD_LINE, "input_length": -5}, "'input_length' must be >= 1"),
    ({**GOOD_LINE, "output_length": -1}, "'output_length' must be >= 1"),
    ({**GOOD_LINE, "hash_ids": [1, 2, 3]}, "3 hash_ids do not match a length of 600"),
    ({**GOOD_LINE, "hash_ids": "abc"}, "'hash_ids' must be a list"),
])
def test_malformed_mooncake_records(tmp_path: Path, record: dict, needle: str) -> None:
    path = _trace(tmp_path, [json.dumps(GOOD_LINE), json.dumps(record)])
    _assert_clean_error(run_cli("run", "--trace", path, "--trace-format", "mooncake"),
                        "trace.jsonl:2", needle)


def test_malformed_kvmetrics_record(tmp_path: Path) -> None:
    path = _trace(tmp_path, [json.dumps({"arrival_s": 0, "output_length": 3})])
    _assert_clean_error(run_cli("run", "--trace", path), "trace.jsonl:1",
                        "prompt_token_ids")


@pytest.mark.parametrize(("args", "needle"), [
    (["--block-size", "0"], "--block-size must be a positive integer"),
    (["--fault-rate", "1.5"], "fault rate must be within 0..1"),
    (["--fault-rate", "-0.1"], "fault rate must be within 0..1"),
    (["--num-gpu-blocks", "4"], "blocks of 16 tokens but the cache holds 3"),
    (["--engine", "tpu"], "argument --engine: invalid choice: 'tpu'"),
    (["--policy", "retry"], "argument --policy: invalid choice: 'retry'"),
    (["--workload", "poetry"], "argument --workload: invalid choice: 'poetry'"),
    (["--verify", "some"], "argument --verify: invalid choice: 'some'"),
    (["--linger", "5"], "--linger needs --serve"),
    (["--verify-fraction", "0.5"], "--verify-fraction needs --verify sampled"),
    (["--report", "/nonexistent-dir/r.html"], "output directory /nonexistent-dir does not"),
    (["--serve", "localhost"], "expected HOST:PORT"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--max-requests", "many"], "invalid int value"),
])
def test_bad_configuration(args: list[str], needle: str) -> None:
    _assert_clean_error(run_cli("run", "--verify", "off", "--max-requests", "5", *args), needle)


def test_bad_fault_plan(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rate": 0.1, "failures": [{"request": "x"}]}))
    _assert_clean_error(run_cli("run", "--verify", "off", "--fault-plan", str(plan)),
                        "failure #0 needs a 'block' index")


def test_failed_run_keeps_earlier_output(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    out.write_text('{"earlier": true}\n')
    result = run_cli("run", "--verify", "off", "--block-size", "0", "--output", str(out))
    assert result.returncode == 2
    assert out.read_text() == '{"earlier": true}\n'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".summary")]


def test_device_choice() -> None:
    _assert_clean_error(run_cli("run", "--device", "tpu", "--max-requests", "3"),
                        "argument --device: invalid choice: 'tpu'")
    result = run_cli("run", "--device", "cuda", "--max-requests", "3", "--json")
    if torch.cuda.is_available():
        assert result.returncode == 0, result.stderr
    else:
        _assert_clean_error(result, "no CUDA device is available")


@pytest.mark.parametrize(("args", "needle"), [
    (["soak", "--engines", "reference,tpu"], "unknown engine 'tpu'"),
    (["soak", "--accounting", "new"], "argument --accounting: invalid choice: 'new'"),
    (["soak", "--shard", "4/4"], "shard must be I/N with 0 <= I < N"),
    (["soak", "--shard", "x"], "shard must be I/N"),
    (["soak", "--jobs", "0"], "--jobs must be a positive integer or auto"),
    (["soak", "--scenarios", "2", "--shard", "0/3"], "shard 0/3 of 2 scenarios is empty"),
    (["report", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["soak-merge", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["catalogue", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_other_commands_refuse_bad_input(args: list[str], needle: str) -> None:
    _assert_clean_error(run_cli(*args), needle)


def test_verify_fraction_with_sampled_is_accepted() -> None:
    result = run_cli("run", "--verify", "sampled", "--verify-fraction", "0.5",
                     "--max-requests", "5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["verify_fraction"] == 0.5


def test_engine_without_vllm_installed_is_one_line() -> None:
    """vLLM made unimportable in the process: --engine vllm is still listed (its entry
    point exists) but refused with one line that says what to install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; from kvmetrics.cli.main import main; "
            "sys.exit(main(['run', '--engine', 'vllm', '--verify', 'off', "
            "'--max-requests', '3']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    _assert_clean_error(result, "--engine vllm is not available", "vLLM is not installed",
                        "bash scripts/install.sh --vllm (docs/user-guide.md#installing)")


# -- every bad input of issue 21: one line, exit 2, nothing written or clobbered -----------

NOT_UTF8 = b'\xff\xfe{"rate": 0.1}\n'
DEEP = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": ' + \
    "[" * 100_000 + "]" * 100_000 + "}"


def _soak_shard(**changes: object) -> dict:
    """A shard report as `kvmetrics soak` writes it (its digest recomputed after the
    changes, so that each case is refused for the problem it is about)."""
    from kvmetrics.lab.soak_report import digest

    base = {"version": 2, "campaign": {"scenarios": 4, "seed": 0, "engines": ["reference"],
                                       "accounting": "unified", "verify": "off",
                                       "recovery": "vllm"},
            "shard": "0/2", "seeds": [0, 2], "scenarios": 2, "invariant_violations": 0,
            "guard_rejected_increments": 0, "verification_failed_blocks": 3, "errors": 0,
            "wall_seconds": 1.0, "failing_seeds": ["reference:1"],
            "failures": [{"seed": 1, "engine": "reference", "invariant_violations": 0,
                          "guard_rejected_increments": 0, "verification_failed_blocks": 3,
                          "error": None}]}
    base.update(changes)
    return {**base, "digest": digest(base)}


def _write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


#: (files to create {name: content}, arguments with {dir} for the folder, text in the line)
BAD_INPUTS = {
    "trace not utf-8": ({"t.jsonl": NOT_UTF8}, ["run", "--trace", "{dir}/t.jsonl"],
                        "not UTF-8"),
    "fault plan not utf-8": ({"p.json": NOT_UTF8}, ["run", "--fault-plan", "{dir}/p.json"],
                             "not UTF-8"),
    "soak-merge not utf-8": ({"s.json": NOT_UTF8}, ["soak-merge", "{dir}/s.json"],
                             "not UTF-8"),
    "report not utf-8": ({"r.json": NOT_UTF8}, ["report", "{dir}/r.json"], "not UTF-8"),
    "surrogate id": ({"t.jsonl": '{"id": "\\ud800", "arrival_s": 0, "prompt_token_ids": [1], '
                                 '"output_length": 2}\n'},
                     ["run", "--trace", "{dir}/t.jsonl"], "'id' must be"),
    "prompt_length 1e20": ({"t.jsonl": '{"arrival_s": 0, "prefix_block_ids": [1], '
                                       '"prompt_length": 100000000000000000000, '
                                       '"output_length": 2}\n'},
                           ["run", "--trace", "{dir}/t.jsonl"], "'prompt_length' is absurdly"),
    "arrival 1e308": ({"t.jsonl": '{"arrival_s": 1e308, "prompt_token_ids": [1], '
                                  '"output_length": 2}\n'},
                      ["run", "--trace", "{dir}/t.jsonl"], "'arrival_s' must be a number"),
    "hash_ids nested 100k deep": ({"t.jsonl": DEEP + "\n"},
                                  ["run", "--trace", "{dir}/t.jsonl", "--trace-format",
                                   "mooncake"], "nested too deeply"),
    "mooncake read as kvmetrics": ({"t.jsonl": json.dumps(GOOD_LINE) + "\n"},
                                   ["run", "--trace", "{dir}/t.jsonl"],
                                   "add --trace-format mooncake"),
    "step seconds 1e-320": ({}, ["run", "--step-seconds", "1e-320"],
                            "--step-seconds must be at least"),
    "num gpu blocks 1e14": ({}, ["run", "--num-gpu-blocks", "100000000000000"],
                            "--num-gpu-blocks must be at most"),
    "kv too big for memory": ({}, ["run", "--verify", "full", "--num-gpu-blocks", "9000000",
                                   "--kv-dim", "4096"], "the data plane's KV would take"),
    "fault plan rate 10^400": ({"p.json": '{"rate": 1' + "0" * 400 + "}"},
                               ["run", "--fault-plan", "{dir}/p.json"],
                               "fault rate must be within 0..1, got 1000"),
    "report wrong-typed field": ({"r.json": json.dumps({
        "engine": "reference", "requests": "many", "steps": 3, "verification": {},
        "timeline": {}})}, ["report", "{dir}/r.json"], "field 'requests' must be an object"),
    "output in a file": ({}, ["run", "--output", "{dir}/out.json/x.json"],
                         "is not a directory"),
    "output is the trace": ({"t.jsonl": json.dumps(GOOD_LINE) + "\n"},
                            ["run", "--trace", "{dir}/t.jsonl", "--trace-format", "mooncake",
                             "--output", "{dir}/t.jsonl"], "same file as --trace"),
    "output is the report": ({}, ["run", "--output", "{dir}/x", "--report", "{dir}/./x"],
                             "--report"),
    "abbreviated option": ({}, ["run", "--fault-rat", "0.1"], "unrecognized arguments"),
    "serve on a bad port": ({}, ["run", "--serve", "127.0.0.1:99999"], "port out of range"),
    "soak-merge edited count": ({"s.json": json.dumps(_soak_shard(
        verification_failed_blocks=2))}, ["soak-merge", "{dir}/s.json"],
        "failures add up to 3"),
    "soak-merge negative count": ({"s.json": json.dumps(_soak_shard(errors=-1))},
                                  ["soak-merge", "{dir}/s.json"], "errors must be an integer"),
    "soak-merge failure outside its seeds": ({"s.json": json.dumps(_soak_shard(failures=[
        {**_soak_shard()["failures"][0], "seed": 3}]))}, ["soak-merge", "{dir}/s.json"],
        "outside the shard's seeds 0..1"),
    "soak-merge different campaigns": ({"a.json": json.dumps(_soak_shard()),
                                        "b.json": json.dumps(_soak_shard(
                                            shard="1/2", seeds=[2, 4], failures=[],
                                            verification_failed_blocks=0, failing_seeds=[],
                                            campaign={**_soak_shard()["campaign"],
                                                      "verify": "full"}))},
                                       ["soak-merge", "{dir}/a.json", "{dir}/b.json"],
                                       "differ in verify"),
    "soak-merge 3 million shards": ({"s.json": json.dumps(_soak_shard(
        shard="0/3000000", campaign={**_soak_shard()["campaign"],
                                     "scenarios": 9_000_000}, seeds=[0, 3], scenarios=3))},
        ["soak-merge", "{dir}/s.json"], "and 2,999,994 more"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    files, args, needle = BAD_INPUTS[case]
    for name, content in files.items():
        _write(tmp_path, name, content)
    keep = tmp_path / "out.json"
    keep.write_text("earlier\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    argv = [a.replace("{dir}", str(tmp_path)) for a in args]
    if argv[0] == "run":
        argv += ["--verify", "off", "--max-requests", "5"] if "--verify" not in argv else []
        if "--output" not in argv:
            argv += ["--output", str(keep)]
    elif argv[0] == "soak-merge":
        argv += ["--output", str(keep)]
    result = run_cli(*argv)
    _assert_clean_error(result, needle)
    assert len(result.stderr) < 600
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_every_option_has_help_with_its_default() -> None:
    from kvmetrics.cli.main import build_parser

    parser = build_parser()
    assert parser.allow_abbrev is False
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, command in sub.choices.items():
        assert command.allow_abbrev is False, name
        command.format_help()  # every help string formats
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.nargs != 0:  # an option with a value says what it is by default
                entry = formatter._expand_help(action)
                assert "default" in entry, f"{name} {action.option_strings}: {entry!r}"


@pytest.mark.parametrize("args", [["--serve", "127.0.0.1:{busy}"],
                                  ["--device", "cuda"]])
def test_cheap_checks_come_before_any_heavy_import(args: list[str]) -> None:
    """A port in use, or --device cuda without a driver, is refused before torch or an
    engine is imported: checked by making torch unimportable in the process."""
    import socket
    import subprocess
    import sys

    if args[0] == "--device" and Path("/proc/driver/nvidia/version").exists():
        args = ["--device", "tpu"]  # with a driver, this machine can run cuda
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [a.replace("{busy}", str(busy.getsockname()[1])) for a in args]
        code = ("import sys; sys.modules['torch'] = None; from kvmetrics.cli.main import main; "
                f"sys.exit(main(['run', '--max-requests', '3', *{argv!r}]))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120)
    _assert_clean_error(result)
