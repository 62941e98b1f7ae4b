"""`hintfs ... --help`: every option and argument of every parser says what it is for, each verb
(and each `hints` action) lists only its own options, and `plan show` prints a header.

The parsers are walked from `build_parser()`, so a verb or option added later is checked too."""
from __future__ import annotations

import argparse
import re

import pytest

from hintfs.cli import build_parser
from hintfs.plan import build_plan
from tests.helpers.cli import hintfs, one_clean_line


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("hintfs",)):
    """(words, parser) of the parser and of every subparser below it, however deep."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSERS = dict(_parsers(build_parser()))


def _listed(parser: argparse.ArgumentParser) -> set[str]:
    """The subcommands a parser's --help lists (those added with a help text)."""
    return {a.dest for sub in parser._actions if isinstance(sub, argparse._SubParsersAction)
            for a in sub._choices_actions}


def test_the_walk_sees_every_verb_and_action():
    words = {" ".join(w) for w in PARSERS}
    assert {"hintfs mount", "hintfs agent", "hintfs governor", "hintfs plan show", "hintfs hints set",
            "hintfs hints wait", "hintfs hints status", "hintfs hints plan", "hintfs hints calibrate"} <= words


@pytest.mark.parametrize("words", list(PARSERS), ids=" ".join)
def test_every_option_and_argument_has_help(words):
    parser = PARSERS[words]
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):   # each subcommand says what it is for
            hidden = {"calibrate"} if words == ("hintfs", "hints") else set()   # the old spelling
            assert set(action.choices) - hidden <= _listed(parser), f"{' '.join(words)}: a subcommand has no help"
            continue
        # argparse.SUPPRESS counts: hidden on purpose (--ready-fd, the old spelling's placeholders)
        assert action.help, f"{' '.join(words)}: {name} has no help text"


def _options(words: tuple[str, ...]) -> set[str]:
    return {o for a in PARSERS[words]._actions for o in a.option_strings}


def test_hints_actions_show_only_their_own_options():
    calibrate = {"--agent", "--path", "--token-file", "--max-readers", "--block", "--seconds", "--size"}
    plan = {"--agents", "--costs", "--safe-readers", "--default-replicas", "--max-replicas", "--json"}
    assert _options(("hintfs", "hints")) == {"-h", "--help", "--debug"}
    assert not (calibrate | plan) & _options(("hintfs", "hints", "set"))
    assert {"--from-dcp", "--file", "--ttl", "--deadline", "--world-size"} <= _options(("hintfs", "hints", "set"))
    assert _options(("hintfs", "hints", "wait")) == {"-h", "--help", "--debug", "--timeout"}
    assert _options(("hintfs", "hints", "status")) == {"-h", "--help", "--debug"}
    assert _options(("hintfs", "hints", "plan")) == plan | {"--world-size", "-h", "--help", "--debug"}
    assert calibrate <= _options(("hintfs", "calibrate"))
    assert not calibrate & _options(("hintfs", "hints", "plan"))


def test_hints_help_lists_actions_not_calibrate():
    r = hintfs("hints", "--help")
    assert r.returncode == 0
    usage = r.stdout.split("\n\n")[0]
    assert "ACTION" in usage and "MOUNTPOINT" not in usage and not re.search(r"--agent\b", r.stdout)
    assert "calibrate" not in r.stdout.split("examples:")[0]


def test_calibrate_usage_asks_for_no_mountpoint():
    r = hintfs("calibrate", "--help")
    usage = r.stdout.split("\n\n")[0]
    assert r.returncode == 0 and "--agent LOCATION" in usage and "mountpoint" not in usage.lower()


def test_the_old_hints_calibrate_spelling_still_parses():
    args = build_parser().parse_args(["hints", "calibrate", "-", "-", "--agent", "grpc://h:1", "--path", "p"])
    assert args.agent == "grpc://h:1" and args.path == "p" and args.func.__name__ == "cmd_calibrate"


def test_hints_action_usage_errors_name_the_action():
    line = one_clean_line(hintfs("hints", "wait", "/x"))
    assert line.startswith("hintfs hints wait: ") and "job" in line and "--help" in line
    line = one_clean_line(hintfs("hints", "set", "/x", "j", "--agent", "grpc://h:1"))
    assert line.startswith("hintfs hints set: unrecognized arguments: --agent") and "hints set --help" in line


def test_plan_show_prints_a_header(tmp_path, capsys):
    plan = tmp_path / "p.parquet"
    build_plan([f"s{i}.jpg" for i in range(16)], str(plan), seed=1, world_size=2, batch_per_rank=2, steps=3)
    args = build_parser().parse_args(["plan", "show", str(plan), "--step", "1"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == ["step", "rank", "slot", "sample", "aug_seed", "est_cost_ms"]
    rows = [line.split("\t") for line in lines[1:]]
    assert len(rows) == 4 and all(row[0] == "1" and len(row) == 6 for row in rows)
    assert sorted(row[1] for row in rows) == ["0", "0", "1", "1"]


def test_plan_show_and_register_errors_name_the_file(tmp_path):
    line = one_clean_line(hintfs("plan", "show", tmp_path / "absent.parquet", "--step", "0"))
    assert line == f"hintfs plan: {tmp_path / 'absent.parquet'}: no such file"
    (tmp_path / "notes.txt").write_text("not a plan")
    line = one_clean_line(hintfs("plan", "show", tmp_path / "notes.txt"))
    assert line.startswith(f"hintfs plan: {tmp_path / 'notes.txt'} is not a Parquet plan: ")
    line = one_clean_line(hintfs("plan", "register", tmp_path, "job", "p.parquet"))
    assert "is not a hintfs mount" in line and "No such file" not in line
