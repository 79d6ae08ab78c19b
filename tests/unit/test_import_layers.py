"""Import layers (docs/design.md), checked in fresh interpreters: what each package may pull in.

- `trainer_client` runs inside synchronous trainers: no zmq.asyncio, asyncio, uvloop,
  starlette, transformers or gateway_workers.
- `broker.protocol` is shared by everyone: stdlib + msgpack only, so not even zmq.
- `broker` never imports `gateway_workers` or `trainer_client`, nor the asyncio stack.
- Per broker sub-package (every module of it imported, found by file): `broker.protocol`,
  `broker.messages` and `broker.codec` load no zmq; of `broker`, the protocol loads only those two,
  the messages only `broker.codec`, the codec nothing else; `broker.sockets` (the ROUTER role) only
  the config (and its `broker.settings`), the wire, `broker.curve` and `broker.zap`; `broker.sessions` nothing
  of `broker.episodes`; neither of those two opens sockets (no zmq, no `broker.server`).
  `broker.episodes` may import `broker.sessions`, not the reverse. `broker.durability` (the state
  directory: log, snapshots, recovery) loads no zmq, no asyncio and nothing of the server or the
  sockets; neither sessions nor episodes load it (only the server and `__main__` wire it in).
- `broker.token_ids` (byte tables, matching prefixes) and `broker.message_keys` (echo keys, shared with
  the trajectory builder) are the other broker modules workers may import: stdlib only (no zmq or msgpack;
  no numpy) and nothing else of `broker`; workers load nothing of the broker's server, sessions or episodes.
- `broker.settings` (settings declared once: flags, variables, checks) is shared by the broker and the workers:
  stdlib only, nothing else of `broker`.
- `broker.curve` (CURVE keys, the loopback rule, handshake monitors) is shared by all three: stdlib and
  zmq, no asyncio (so not `zmq.auth.thread`) and nothing else of `broker` but `broker.settings`; the
  broker's ZAP handler (`broker.zap`, blocking) loads only `broker.curve`, and neither workers nor the
  trainer client load it.
- Per gateway sub-package, along a turn's path: the HTTP edge's connection, errors and limits load
  nothing of the gateway; `rendering` nothing of the turn, the formats, engines or capture;
  `formats` nothing of adapters, turns, engines or capture; `engines` and `capture` nothing of the
  rest of the turn (and capture no transformers); `turns` nothing of the adapters; no sub-package
  loads the app, and rendering, formats and engines load no zmq.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPORT_TIMEOUT_S = 60

CASES = {
    "trainer_client": [
        "zmq.asyncio",
        "asyncio",
        "uvloop",
        "starlette",
        "transformers",
        "gateway_workers",
        "broker.server",
        "broker.zap",
    ],
    "broker.protocol": [
        "zmq",
        "asyncio",
        "broker.server",
        "broker.sessions.registry",
        "gateway_workers",
        "trainer_client",
    ],
    "broker.server": [
        "zmq.asyncio",
        "asyncio",
        "uvloop",
        "starlette",
        "transformers",
        "gateway_workers",
        "trainer_client",
        "tokenizers",
    ],
    "broker.__main__": ["zmq.asyncio", "asyncio", "transformers", "gateway_workers", "trainer_client"],
    "gateway_workers.app": ["broker.server", "broker.sessions", "broker.episodes", "broker.zap", "trainer_client"],
}


class Layer(NamedTuple):
    """What importing every module of a sub-package may load: nothing under `forbid`, and of `broker`
    only what is under `broker_only` (when given)."""

    forbid: tuple[str, ...]
    broker_only: tuple[str, ...] | None = None


_WIRE = ("broker.protocol", "broker.messages", "broker.codec")
SUBPACKAGES = {
    "broker.protocol": Layer(forbid=("zmq", "asyncio"), broker_only=_WIRE),
    "broker.messages": Layer(forbid=("zmq", "asyncio"), broker_only=("broker.messages", "broker.codec")),
    "broker.codec": Layer(forbid=("zmq", "asyncio"), broker_only=("broker.codec",)),
    "broker.sockets": Layer(
        forbid=("asyncio",),
        broker_only=("broker.sockets", "broker.config", "broker.settings", "broker.curve", "broker.zap", *_WIRE),
    ),
    "broker.curve": Layer(forbid=("asyncio", "zmq.asyncio"), broker_only=("broker.curve", "broker.settings")),
    "broker.zap": Layer(forbid=("asyncio", "zmq.asyncio"),
                        broker_only=("broker.zap", "broker.curve", "broker.settings")),
    "broker.settings": Layer(forbid=("zmq", "asyncio"), broker_only=("broker.settings",)),
    "broker.sessions": Layer(forbid=("broker.episodes", "broker.server", "broker.durability", "zmq", "asyncio")),
    # broker.sessions is allowed
    "broker.episodes": Layer(forbid=("broker.server", "broker.durability", "zmq", "asyncio")),
    "broker.durability": Layer(
        forbid=("zmq", "asyncio", "broker.server", "broker.sockets", "broker.zap", "gateway_workers", "trainer_client")
    ),
    "broker.token_ids": Layer(
        forbid=("zmq", "asyncio", "numpy", "msgpack", "tokenizers"), broker_only=("broker.token_ids",)
    ),
    "broker.message_keys": Layer(forbid=("zmq", "asyncio", "msgpack"), broker_only=("broker.message_keys",)),
    # the message handlers and the state they share: no sockets, nothing of the server's loop
    "broker.handlers": Layer(forbid=("zmq", "asyncio", "broker.server", "broker.sockets", "broker.zap",
                                     "gateway_workers", "trainer_client")),
    # decode, route, encode: no sockets either
    "broker.dispatch": Layer(forbid=("zmq", "asyncio", "broker.server", "broker.sockets", "broker.zap",
                                     "gateway_workers", "trainer_client")),
    "broker.state": Layer(forbid=("zmq", "asyncio", "broker.server", "broker.sockets", "broker.zap",
                                  "broker.handlers", "gateway_workers", "trainer_client")),
    "broker.metrics": Layer(forbid=("zmq", "asyncio", "broker.server", "broker.sessions", "broker.episodes",
                                    "broker.durability", "gateway_workers", "trainer_client")),
}
_GW = "gateway_workers."
_TURN_PATH = tuple(_GW + p for p in ("adapters", "turns", "rendering", "formats", "engines", "capture"))
_NOT_BROKER_STATE = ("broker.server", "broker.sessions", "broker.episodes")
_DIALECT_MODULES = ("openai_chat", "chat_messages", "anthropic_messages", "anthropic_blocks", "openai_responses",
                    "responses_items")


def _gateway_layer(*forbid: str, also: tuple[str, ...] = ()) -> Layer:
    return Layer(forbid=(*(_GW + f for f in forbid), _GW + "app", *_NOT_BROKER_STATE, "trainer_client", *also))


SUBPACKAGES.update({
    "gateway_workers.http.connection": Layer(forbid=(*_TURN_PATH, _GW + "app", "starlette", "zmq")),
    "gateway_workers.http.errors": Layer(forbid=(*_TURN_PATH, _GW + "app", "starlette", "zmq")),
    "gateway_workers.http.limits": Layer(forbid=(*_TURN_PATH, _GW + "app", "starlette", "zmq")),
    "gateway_workers.metrics": Layer(forbid=(*_TURN_PATH, _GW + "app", "starlette", "zmq", "transformers")),
    "gateway_workers.rendering": _gateway_layer("adapters", "turns", "formats", "engines", "capture", "http",
                                                also=("zmq", "starlette", "broker.protocol")),
    "gateway_workers.formats": _gateway_layer("adapters", "turns", "engines", "capture", "http",
                                              also=("zmq", "starlette")),
    "gateway_workers.engines": _gateway_layer("adapters", "turns", "rendering", "formats", "capture", "http",
                                              also=("zmq", "starlette")),
    "gateway_workers.capture": _gateway_layer("adapters", "turns", "rendering", "formats", "engines", "http",
                                              also=("transformers", "starlette")),
    "gateway_workers.turns": _gateway_layer("adapters", also=("starlette",)),
    # what a turn carries: none of the steps that make it
    "gateway_workers.turns.captured": Layer(forbid=tuple(_GW + "turns." + m for m in ("pipeline", "live", "replay",
                                                                                      "start"))),
    "gateway_workers.adapters": _gateway_layer(also=("starlette",)),
    # the verdict table and the dialect-free tools: nothing of a dialect's adapter
    "gateway_workers.adapters.request_fields": Layer(forbid=(_GW + "adapters.common", _GW + "adapters.tools",
                                                             *_TURN_PATH[1:], "broker", "zmq", "starlette")),
    "gateway_workers.adapters.request_field_rules": Layer(forbid=(_GW + "adapters.common", _GW + "adapters.tools",
                                                                  *_TURN_PATH[1:], "broker", "zmq", "starlette")),
    "gateway_workers.adapters.tools": Layer(forbid=tuple(_GW + "adapters." + m for m in _DIALECT_MODULES)),
    "gateway_workers.adapters.tool_readers": Layer(forbid=tuple(_GW + "adapters." + m for m in _DIALECT_MODULES)),
})
# Packages in which no two modules import each other, directly or around a longer circle (read from the source:
# an import under TYPE_CHECKING counts too). The trainer client's seam to the broker (`control_socket`) is under
# the client and its episode streams, never over them.
NO_CIRCLES = ("trainer_client", "gateway_workers.adapters", "gateway_workers.turns", "gateway_workers.formats",
              "broker.handlers", "broker.sessions")


def modules_of(package: str) -> list[str]:
    """Every module of `package` (a module or a package), by its files: no import in this process."""
    path = REPO_ROOT.joinpath(*package.split("."))
    if not path.is_dir():
        return [package]
    names = []
    for file in sorted(path.rglob("*.py")):
        parts = file.relative_to(REPO_ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def all_loaded_after_import(modules: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def loaded_after_import(module: str, watch: list[str]) -> list[str]:
    loaded = set(all_loaded_after_import([module]))
    return [m for m in watch if m in loaded]


@pytest.mark.parametrize("module", list(CASES))
def test_import_layers(module):
    assert loaded_after_import(module, CASES[module]) == []


@pytest.mark.parametrize("package", list(SUBPACKAGES))
def test_sub_package_layers(package):
    layer = SUBPACKAGES[package]
    modules = modules_of(package)
    assert modules, f"no modules found for {package}"
    loaded = all_loaded_after_import(modules)
    assert [m for m in loaded if under(m, layer.forbid)] == []
    if layer.broker_only is not None:
        assert [m for m in loaded if under(m, ("broker",)) and m != "broker" and not under(m, layer.broker_only)] == []


def _imports(module: str) -> set[str]:
    """The modules of our packages `module`'s source imports (`from a.b import c` counts `a.b.c` when that is one)."""
    path = REPO_ROOT.joinpath(*module.split("."))
    source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports in `edges` (module -> the modules it imports), each once, from its least module."""
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(edges.get(module, ())):
            if target == path[0]:
                found.append([*path, target])
            elif target not in path and target > path[0]:
                visit(target, [*path, target])

    for module in sorted(edges):
        visit(module, [module])
    return found


@pytest.mark.parametrize("package", NO_CIRCLES)
def test_no_modules_import_each_other(package):
    modules = [m for m in modules_of(package) if m != package]
    assert circles({m: {n for n in _imports(m) if n in modules and n != m} for m in modules}) == []


def test_the_circle_finder_sees_circles():
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": {"c"}}) == []
    assert "trainer_client.control_socket" in _imports("trainer_client.subscriber")  # the source is read


def test_the_watch_is_real():
    # the probe sees what an import does load, so an empty answer above means something
    assert "zmq" in loaded_after_import("trainer_client", ["zmq"])
    assert "msgpack" in loaded_after_import("broker.protocol", ["msgpack"])
    # the sub-package probe finds every module and sees what they pull in
    assert {"broker.sessions.compaction", "broker.sessions.logs.ranges"} <= set(modules_of("broker.sessions"))
    assert {"broker.codec.fast", "broker.messages.worker"} <= set(all_loaded_after_import(["broker.protocol"]))
    assert {"broker.messages.common", "broker.messages.trainer"} <= set(modules_of("broker.messages"))
    assert any(under(m, ("broker.sessions",)) for m in all_loaded_after_import(modules_of("broker.episodes")))
    assert {"broker.durability.wal", "broker.durability.recovery"} <= set(modules_of("broker.durability"))
    assert "broker.durability.store" in all_loaded_after_import(["broker.server"])
    assert any(under(m, (_GW + "engines",)) for m in all_loaded_after_import(modules_of(_GW + "turns")))
    assert "zmq" in all_loaded_after_import(modules_of(_GW + "capture"))
    assert "broker.curve" in loaded_after_import("trainer_client", ["broker.curve"])
    assert "zmq.auth.certs" in all_loaded_after_import(["broker.curve"])
