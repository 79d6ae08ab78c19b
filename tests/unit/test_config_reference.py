"""The README's configuration table checked against the real parsers, so the reference cannot drift from the code.

Every option of `serve`, `workers` and `broker` has exactly one row that names the subcommands taking it; every
variable the code reads (each `BrokerConfig` field's, the request limits', the CURVE and CA ones) is in it; a row
naming a flag or a variable the code lacks fails; every option has help text; and `rollout-gateway <cmd> --help`
run as a subprocess lists each option of that subcommand (for `broker`, the broker's own parser, which it execs).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import broker.__main__ as broker_main
from broker import curve
from broker.config import ENV_PREFIX, BrokerConfig
from gateway_workers import cli

README = Path(__file__).resolve().parents[2] / "README.md"
DOCUMENTED = ("serve", "workers", "broker")
HELP_TIMEOUT_S = 60
# Read by the tokenizer cache (`rendering.tokenizer.cache_root`); not a constant of ours to import.
OTHER_ENV = "XDG_CACHE_HOME"

_FLAG = re.compile(r"(?<![\w-])--?[a-z][a-z0-9-]*")
_ENV = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")


@dataclasses.dataclass(frozen=True)
class Row:
    flags: frozenset[str]
    envs: frozenset[str]
    subcommands: frozenset[str]
    line: str


def _rows(text: str) -> list[Row]:
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:3] == ["flag", "env variable", "subcommands"], header
    rows = []
    for line in table[2:]:  # after the header and its |---| line
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), line
        subcommands = frozenset(s.strip(" `") for s in cells[2].split(","))
        rows.append(Row(frozenset(_FLAG.findall(cells[0])), frozenset(_ENV.findall(cells[1])), subcommands, line))
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("rollout-gateway has no subcommands")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser as its --help sees it: `broker` execs the broker's own."""
    sub = _subparsers(cli._parser())
    return {**sub, "broker": broker_main._parser()}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def _broker_field(action: argparse.Action) -> str:
    return broker_main._FIELD_OF_DEST.get(action.dest, action.dest)


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return _rows(README.read_text("utf-8"))


def test_every_flag_has_one_row_naming_exactly_the_subcommands_that_take_it(rows: list[Row]):
    parsers = _parsers()
    taken: dict[str, set[str]] = {}
    for name in DOCUMENTED:
        for option in _options(parsers[name]):
            taken.setdefault(option, set()).add(name)
    documented: dict[str, frozenset[str]] = {}
    for row in rows:
        assert len(row.flags) <= 1, f"one flag per row: {row.line}"
        for flag in row.flags:
            assert flag not in documented, f"{flag} has two rows"
            documented[flag] = row.subcommands
    assert sorted(set(taken) - set(documented)) == [], "flags without a row in the README's Configuration table"
    assert sorted(set(documented) - set(taken)) == [], "rows for flags that no parser has"
    wrong = {flag: (sorted(documented[flag]), sorted(subs)) for flag, subs in taken.items() if documented[flag] != subs}
    assert wrong == {}, "flag: (subcommands in the README, subcommands that take it)"


def test_every_variable_has_a_row_and_no_row_names_one_the_code_lacks(rows: list[Row]):
    broker_envs = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(BrokerConfig)}
    limit_envs = {cli.LIMITS_ENV_PREFIX + name.upper() for name in cli._LIMIT_FLAGS}
    expected = broker_envs | limit_envs | {curve.CURVE_KEYS_ENV, cli.ENGINE_CA_FILE_ENV, OTHER_ENV}
    documented = {env for row in rows for env in row.envs}
    assert sorted(expected - documented) == [], "variables without a row"
    assert sorted(documented - expected) == [], "rows for variables that the code does not read"
    for row in rows:
        if not row.flags and row.envs & broker_envs:
            # serve's broker reads them too; no worker does
            assert row.subcommands == {"serve", "broker"}, row.line


def test_each_flag_row_names_the_variable_that_flag_overrides(rows: list[Row]):
    by_flag = {flag: row for row in rows for flag in row.flags}
    own: dict[str, set[str]] = {}
    for action in _parsers()["broker"]._actions:
        if action.option_strings and action.dest != "help":
            own.setdefault(action.option_strings[0], set()).add(ENV_PREFIX + _broker_field(action).upper())
    for name in cli._LIMIT_FLAGS:
        own.setdefault("--" + name.replace("_", "-"), set()).add(cli.LIMITS_ENV_PREFIX + name.upper())
    own.setdefault("--curve-keys", set()).add(curve.CURVE_KEYS_ENV)
    own.setdefault("--engine-ca-file", set()).add(cli.ENGINE_CA_FILE_ENV)
    missing = {flag: sorted(envs - by_flag[flag].envs) for flag, envs in own.items() if envs - by_flag[flag].envs}
    assert missing == {}, "flag: the variables its row should name"


def test_every_broker_flag_sets_a_config_field():
    fields = {f.name for f in dataclasses.fields(BrokerConfig)}
    for action in _parsers()["broker"]._actions:
        if action.dest != "help":
            assert _broker_field(action) in fields, action.option_strings


def test_every_option_and_subcommand_has_help_text():
    parsers = {"rollout-gateway": cli._parser(), **_parsers()}
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert (choice.help or "").strip(), f"subcommand {choice.dest} has no help"
                continue
            assert action.help != argparse.SUPPRESS, f"{name} {action.option_strings} is hidden from --help"
            assert (action.help or "").strip(), f"{name} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("subcommand", ["serve", "workers", "broker", "keys"])
def test_help_lists_every_option_of_the_subcommand(subcommand: str):
    done = subprocess.run(
        [sys.executable, "-m", "gateway_workers.cli", subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    parser = _parsers()[subcommand]
    for option in _options(parser):
        # at a line's start: listed as an option, not merely named in another's help
        assert re.search(rf"^\s+{re.escape(option)}\b", done.stdout, re.M), f"{subcommand} --help lacks {option}"
    if subcommand == "broker":
        unflagged = {f.name for f in dataclasses.fields(BrokerConfig)} - {_broker_field(a) for a in parser._actions}
        text = " ".join(done.stdout.split())
        assert unflagged and all(ENV_PREFIX + name.upper() in text for name in unflagged), text


def test_an_empty_curve_keys_flag_means_no_keys_whatever_the_environment_says(monkeypatch):
    """`serve` passes `--curve-keys ""` to its own broker when it runs without CURVE: a variable must not turn
    CURVE on for that broker alone, or its workers could not connect."""
    from broker.__main__ import _parser, config_from_args

    monkeypatch.setenv("ROLLOUT_BROKER_CURVE_KEYS", "/some/keys")
    monkeypatch.setenv("ROLLOUT_GATEWAY_CURVE_KEYS", "/other/keys")
    assert config_from_args(_parser().parse_args(["--curve-keys", ""])).curve_keys is None
    assert config_from_args(_parser().parse_args(["--curve-keys", "/mine"])).curve_keys == "/mine"
    assert config_from_args(_parser().parse_args([])).curve_keys == "/other/keys"
