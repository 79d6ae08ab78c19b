"""Settings declared once, checked from outside: the configuration reference is the generated one, every flag of
`serve`, `workers` and `broker` sets a declared setting and has help, `--help` lists them, and every setting's
variable and flag reach the config the command builds, the flag winning.

The last is a property over every declared setting: a value other than the default, given by its variable, is
what the built config holds; given by its flag as well, the flag's value is.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker import settings
from broker.config import BrokerConfig
from gateway_workers import cli
from gateway_workers.config import ServeConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
HELP_TIMEOUT_S = 60
# Every setting below is tried with an engine URL set, so that a non-mock engine kind is a valid value.
BASE_ENV = {"ROLLOUT_GATEWAY_ENGINE_URLS": "http://engine:1"}


def _load_reference_script() -> Any:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    return config_reference


reference = _load_reference_script()


def test_the_configuration_reference_is_the_generated_one():
    assert reference.current() == reference.reference(), "run python scripts/config_reference.py"


def test_the_check_command_fails_on_a_stale_reference(tmp_path, monkeypatch):
    stale = tmp_path / "configuration.md"
    stale.write_text(reference.DOC.read_text("utf-8").replace("`ROLLOUT_BROKER_HWM`", "`ROLLOUT_BROKER_HW`"))
    monkeypatch.setattr(reference, "DOC", stale)
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    assert reference.main() == 1
    monkeypatch.setattr(sys, "argv", ["config_reference.py"])
    assert reference.main() == 0 and reference.current() == reference.reference()


@pytest.mark.parametrize("command", ["serve", "workers", "broker"])
def test_every_flag_sets_a_declared_setting_and_has_help(command: str):
    parser = reference.parsers()[command]
    for action in parser._actions:
        if action.dest == "help":
            continue
        entry = getattr(action, "setting_entry", None)
        assert entry is not None, f"{command} {action.option_strings} sets no declared setting"
        assert (action.help or "").strip() and action.help != argparse.SUPPRESS
        assert entry.flag in action.option_strings


def test_every_subcommand_has_help_text():
    for action in cli._parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all((choice.help or "").strip() for choice in action._choices_actions)


@pytest.mark.parametrize("subcommand", ["serve", "workers", "broker", "keys"])
def test_help_lists_every_option_of_the_subcommand(subcommand: str):
    done = subprocess.run(
        [sys.executable, "-m", "gateway_workers.cli", subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    parser = {**reference.parsers(), "keys": None}[subcommand]
    options = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"} if parser else set()
    for option in options:
        # at a line's start: listed as an option, not merely named in another's help
        assert re.search(rf"^\s+{re.escape(option)}\b", done.stdout, re.M), f"{subcommand} --help lacks {option}"
    if subcommand == "broker":  # and the settings only a variable sets
        text = " ".join(done.stdout.split())
        unflagged = [e.envs[0] for e in settings.entries(BrokerConfig) if e.flag is None]
        assert unflagged and all(env in text for env in unflagged), text


def _other_value(entry: settings.Entry) -> tuple[Any, str]:
    """A valid value other than the default, and its text."""
    if entry.switch:
        return (not entry.default), "1" if not entry.default else "0"
    if entry.choices is not None:
        value = next(c for c in reversed(entry.choices) if c != entry.default)
        return value, value
    if entry.many:
        return ("http://engine:2",), "http://engine:2"
    if entry.name.endswith("endpoint") or entry.name == "control_endpoint":
        return "tcp://127.0.0.1:9", "tcp://127.0.0.1:9"
    if entry.name == "log_level":
        return ("DEBUG", "DEBUG") if entry.default == "INFO" else ("debug", "debug")
    base = settings._base(entry.hint)
    if base is int:
        value = (entry.default or 0) + 3
        return value, str(value)
    if base is float:
        value = (entry.default or 0.0) + 1.5
        return value, str(value)
    return "some-value", "some-value"


def _commands(config: type) -> list[tuple[str, type]]:
    return [(command, config) for command, configs in reference.BUILDS.items() if config in configs]


def _built(command: str, config: type, argv: list[str], env: dict[str, str]) -> Any:
    if command == "broker":
        import broker.__main__ as broker_main

        return settings.build(BrokerConfig, broker_main._parser().parse_args(argv), {**BASE_ENV, **env})
    args = cli._parser().parse_args([command, *argv])
    defaults = cli.SERVE_BROKER_DEFAULTS if config is BrokerConfig else None
    return settings.build(config, args, {**BASE_ENV, **env}, defaults=defaults)


def _value(config: Any, entry: settings.Entry) -> Any:
    for name in entry.path:
        config = getattr(config, name)
    return config


CASES = [(command, config, entry) for config in (ServeConfig, BrokerConfig) for command, _ in _commands(config)
         for entry in settings.entries(config)]


@pytest.mark.parametrize(("command", "config", "entry"), CASES,
                         ids=[f"{c}-{e.dest}" for c, _, e in CASES])
def test_each_setting_comes_from_its_variable_and_its_flag_wins(command: str, config: type, entry: settings.Entry):
    parser = reference.parsers()[command]
    taken = entry in reference.flagged(parser)
    value, text = _other_value(entry)
    for env in entry.envs:
        assert _value(_built(command, config, [], {env: text}), entry) == value, env
    if not taken:
        return
    if entry.switch:  # its flag turns it on, over a variable that says off
        argv, variable = [entry.flag], "0"
    else:
        argv, variable = [entry.flag, text], _another_text(entry, value)
    env = {entry.envs[0]: variable} if entry.envs else {}
    assert _value(_built(command, config, argv, env), entry) == (True if entry.switch else value)


def _another_text(entry: settings.Entry, taken: Any) -> str:
    """A second valid value's text, for the variable a flag must win over."""
    if entry.choices is not None:
        return next(c for c in entry.choices if c != taken)
    if entry.many:
        return "http://engine:3"
    base = settings._base(entry.hint)
    if base in (int, float):
        return str((entry.default or 0) + 5)
    return "" if entry.default is None else str(entry.default)


def test_a_value_that_does_not_parse_or_fails_its_check_names_its_source():
    with pytest.raises(settings.SettingError, match="ROLLOUT_BROKER_MAX_SESSIONS='lots'"):
        settings.build(BrokerConfig, None, {"ROLLOUT_BROKER_MAX_SESSIONS": "lots"})
    with pytest.raises(settings.SettingError, match="ROLLOUT_BROKER_MAX_SESSIONS='0'.*must be positive"):
        settings.build(BrokerConfig, None, {"ROLLOUT_BROKER_MAX_SESSIONS": "0"})
    with pytest.raises(SystemExit, match="--max-tools: worker.limits.max_tools must be an integer >= 1"):
        cli._settings(cli._parser().parse_args(["serve", "--max-tools", "0"]))


def test_an_empty_curve_keys_flag_means_no_keys_whatever_the_environment_says(monkeypatch):
    """An empty `--curve-keys` turns CURVE off for that broker, whatever a variable says."""
    from broker.__main__ import _parser, config_from_args

    monkeypatch.delenv("ROLLOUT_BROKER_CONFIG", raising=False)
    monkeypatch.setenv("ROLLOUT_BROKER_CURVE_KEYS", "/some/keys")
    monkeypatch.setenv("ROLLOUT_GATEWAY_CURVE_KEYS", "/other/keys")
    assert config_from_args(_parser().parse_args(["--curve-keys", ""])).curve_keys is None
    assert config_from_args(_parser().parse_args(["--curve-keys", "/mine"])).curve_keys == "/mine"
    assert config_from_args(_parser().parse_args([])).curve_keys == "/other/keys"
