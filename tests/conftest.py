"""Shared fixtures: the real test tokenizers (Qwen BPE + real chat templates) and the fake engine process.

The built-in BPE is built once into the on-disk cache (gateway_workers.rendering.tokenizer) and
reused by every xdist worker and later run; `qwen3_tokenizer_dir` is the same cache dir
variant carrying trl's qwen3.jinja, for subprocesses. transformers is imported inside the
fixtures, so test modules that never ask for a tokenizer do not pay for it.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import assets` from any test module

from assets import FakeEngine, trl_qwen3_template_path  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _no_leaks_left_for_later() -> Iterator[None]:
    """After each module, collect its garbage and fail if that closed a leaked resource (a socket, a file): left
    to the collector, it would warn in whichever test runs then, blaming an unrelated one. Here the module that
    leaked it fails, naming what it leaked."""
    yield
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    leaked = [_leak(w) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaked == [], f"this module's tests left resources unclosed: {leaked}"


def _leak(warning: warnings.WarningMessage) -> str:
    """What leaked, and where it was made when tracemalloc traces (`python -X tracemalloc=20 -m pytest ...`)."""
    made = tracemalloc.get_object_traceback(warning.source) if warning.source is not None else None
    return f"{warning.message}" + (" made at\n" + "\n".join(made.format()) if made is not None else "")


@pytest.fixture(scope="session")
def qwen3_template_path() -> Path:
    """trl's real qwen3.jinja, read as data from the installed wheel."""
    return trl_qwen3_template_path()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_template_path: Path) -> Any:
    """The built-in Qwen BPE with trl's qwen3.jinja as its chat template."""
    from gateway_workers.rendering.tokenizer import load_tokenizer

    return load_tokenizer(None, chat_template_path=str(qwen3_template_path))


@pytest.fixture(scope="session")
def builtin_tokenizer() -> Any:
    """The built-in offline default: Qwen BPE with our own Qwen3-style template."""
    from gateway_workers.rendering.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(qwen3_template_path: Path) -> str:
    """A directory (tokenizer.json + qwen3.jinja) for subprocesses: `--tokenizer DIR`."""
    from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

    return prepare_tokenizer_dir(None, chat_template_path=str(qwen3_template_path))


@pytest.fixture(scope="module")
def fake_engine(qwen3_tokenizer_dir: str) -> Iterator[FakeEngine]:
    """A fake vLLM/SGLang engine process for this module; tests scope faults by routing key or reset."""
    with FakeEngine(qwen3_tokenizer_dir) as engine:
        yield engine
