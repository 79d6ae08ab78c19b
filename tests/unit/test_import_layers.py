"""Import layers (STYLE.md), checked in fresh interpreters: what each package may pull in.

- `trainer_client` runs inside synchronous trainers: no zmq.asyncio, asyncio, uvloop,
  starlette, transformers or gateway_workers.
- `broker.protocol` is shared by everyone: stdlib + msgpack only, so not even zmq.
- `broker` never imports `gateway_workers` or `trainer_client`, nor the asyncio stack.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPORT_TIMEOUT_S = 60

CASES = {
    "trainer_client": ["zmq.asyncio", "asyncio", "uvloop", "starlette", "transformers", "gateway_workers"],
    "broker.protocol": ["zmq", "asyncio", "broker.server", "broker.sessions.registry", "gateway_workers", "trainer_client"],
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
}


def loaded_after_import(module: str, watch: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {watch!r} if m in sys.modules]))\n"
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


@pytest.mark.parametrize("module", list(CASES))
def test_import_layers(module):
    assert loaded_after_import(module, CASES[module]) == []


def test_the_watch_is_real():
    # the probe sees what an import does load, so an empty answer above means something
    assert "zmq" in loaded_after_import("trainer_client", ["zmq"])
    assert "msgpack" in loaded_after_import("broker.protocol", ["msgpack"])
