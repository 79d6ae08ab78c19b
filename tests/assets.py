"""Test assets: the real Qwen3 chat template from the trl wheel, sample tools, and the fake engine process.

trl is data here, never code: its `chat_templates/qwen3.jinja` is located through the
import system's finder without importing trl. The fake engine runs as a real subprocess
(`tests/fake_engine.py`) under tests/processes.py's TestProcess: its own process group,
a readiness line awaited with a deadline, SIGTERM then SIGKILL by group, output dumped
when a test fails. Imports only the stdlib, so any test module may import it cheaply.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from processes import TestProcess

TRL_QWEN3_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
FAKE_ENGINE_SCRIPT = Path(__file__).with_name("fake_engine.py")
FAKE_ENGINE_START_TIMEOUT_S = 30.0
PROCESS_STOP_TIMEOUT_S = 5.0
CONTROL_TIMEOUT_S = 5.0

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


def trl_qwen3_template_path() -> Path:
    """Path of trl's qwen3.jinja in the installed wheel, found without importing trl."""
    spec = importlib.util.find_spec("trl")  # for a top-level package this locates, never executes
    if spec is None or spec.origin is None:
        raise RuntimeError("the trl wheel is not installed; the tests read its qwen3.jinja as data")
    path = Path(spec.origin).parent / "chat_templates" / "qwen3.jinja"
    if not path.is_file():
        raise RuntimeError(f"trl is installed but {path} is missing")
    return path


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakeEngine:
    """A running `tests/fake_engine.py` process (a TestProcess): its base url and its test controls."""

    def __init__(self, tokenizer_dir: str, tool_rounds: int = 2) -> None:
        self.process = TestProcess(
            [
                sys.executable,
                "-u",
                str(FAKE_ENGINE_SCRIPT),
                "--port",
                "0",
                "--tokenizer",
                tokenizer_dir,
                "--tool-rounds",
                str(tool_rounds),
            ],
            name="fake_engine",
        ).start()
        try:
            self.url = self.process.expect(r"FAKE ENGINE READY (\S+)", FAKE_ENGINE_START_TIMEOUT_S).group(1)
        except BaseException:
            self.process.stop()
            raise

    def configure(self, **body: Any) -> None:
        """POST /_fake/config, e.g. reset=True, fault={"status": 500, "times": 1, "key": ...}."""
        self._call("/_fake/config", body)

    def log(self, key: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """GET /_fake/log: requests, aborts and disconnects seen (optionally for one routing key)."""
        suffix = f"?key={key}" if key is not None else ""
        return self._call(f"/_fake/log{suffix}", None)

    def _call(self, path: str, body: dict[str, Any] | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=CONTROL_TIMEOUT_S) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it if it lingers."""
        self.process.stop(PROCESS_STOP_TIMEOUT_S)  # its output's reader closes the pipe at EOF

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        if exc_type is not None:
            self.process.dump()


def wait_until(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is truthy or `timeout` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
