"""Seeded text for simulated agents: word-salad filler, and tool results shaped like real ones.

`filler` is single-spaced one-token words (prose at its cheapest to tokenize). `tool_result(...,
"mixed")` is what tools really return: indented JSON records, Python source, and English-like
prose with Zipfian word frequencies, punctuation, numbers and a little non-ASCII, sized in
tokens by the benchmark's tokenizer once `use_vocabulary` named it (else ~3.5 characters a token).
Every text is a function of its seed. Mixed ones are drawn from a fixed pool of parts, so two
may repeat each other; `loadgen`'s messages stay unique by their seeded prefixes.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

# One Qwen BPE token each, with their leading space; `use_vocabulary` swaps in thousands from a tokenizer.
WORDS = "alpha delta echo golf hotel india mike november uniform whiskey".split()
TOOL_TEXTS = ("prose", "mixed")
_CHARS_PER_TOKEN = 3.5  # without a tokenizer to count with
_EXTRA = ["naïve", "café", "→", "—", "数据", "日本語", "µs", "±3", "°C", "Ω"]  # ~2% of mixed prose words
_KEYS = ["id", "name", "status", "score", "tags", "path", "updated_at", "owner", "size", "children"]
_POOL_PARTS = 600  # distinct parts that mixed tool results are drawn from, in a seeded order
_counter: Any = None  # a `tokenizers.Tokenizer` once `use_vocabulary` ran
_parts: list[tuple[str, int]] | None = None  # the pool, drawn with the current vocabulary


def filler(tokens: int, seed: int | str) -> str:
    """~`tokens` tokens of seeded word salad (unique per seed, so no two agents or runs share a message)."""
    return "".join(" " + w for w in random.Random(seed).choices(WORDS, k=max(1, tokens)))


def use_vocabulary(tokenizer_dir: str, size: int = 4000) -> None:
    """Draw words from `size` lowercase words that are one token (with a leading space) in this tokenizer."""
    global _counter, _parts
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    vocab = json.loads(open(path, encoding="utf-8").read())["model"]["vocab"]
    words = sorted(
        w[1:]
        for w in vocab
        if w.startswith("\u0120") and len(w) >= 5 and w[1:].isalpha() and w[1:].islower() and w[1:].isascii()
    )
    if len(words) >= 100:
        WORDS[:] = random.Random(0).sample(words, min(size, len(words)))
    from tokenizers import Tokenizer

    _counter = Tokenizer.from_file(path)
    _parts = None


def tool_result(tokens: int, seed: int | str, kind: str = "prose") -> str:
    """~`tokens` tokens of a tool's output: `filler` ("prose") or JSON, code and prose mixed ("mixed")."""
    if kind == "prose":
        return filler(tokens, seed)
    if kind != "mixed":
        raise ValueError(f"tool text must be one of {TOOL_TEXTS}, got {kind!r}")
    rng = random.Random(seed)
    pool = _pool()
    parts: list[str] = []
    left = max(1, tokens)
    while left > 0:
        part, n = rng.choice(pool)
        if n > left:  # the last part: cut it to size (by characters, so the count is approximate)
            part = part[: max(1, len(part) * left // n)]
        parts.append(part)
        left -= n
    return "\n\n".join(parts)


def _pool() -> list[tuple[str, int]]:
    """Parts (JSON, code, prose) with their token counts, drawn once: generating and counting each
    tool result anew cost ~2 ms of the load generator's core a turn, enough to throttle it."""
    global _parts
    if _parts is None:
        rng = random.Random(0)
        made = [rng.choice((_json_records, _python_source, _prose))(rng) for _ in range(_POOL_PARTS)]
        _parts = [(part, _count(part)) for part in made]
    return _parts


def _count(text: str) -> int:
    if _counter is None:
        return max(1, round(len(text) / _CHARS_PER_TOKEN))
    return len(_counter.encode(text, add_special_tokens=False).ids)


def _word(rng: random.Random) -> str:
    rank = int(len(WORDS) ** rng.random()) - 1  # log-uniform: rank r has weight ~1/r, as Zipf's law has it
    return WORDS[rank] if rng.random() > 0.02 else rng.choice(_EXTRA)


def _prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 6)):
        words = [_word(rng) for _ in range(rng.randint(6, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(2, 2026)))
        if rng.random() < 0.4:
            words[rng.randrange(len(words))] += ","
        sentences.append(" ".join(words).capitalize() + rng.choice(".?:."))
    return " ".join(sentences)


def _json_records(rng: random.Random) -> str:
    def record(depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in rng.sample(_KEYS, rng.randint(3, 7)):
            pick = rng.random()
            if key == "children" and depth < 2:
                out[key] = [record(depth + 1) for _ in range(rng.randint(0, 2))]
            elif pick < 0.3:
                out[key] = rng.randint(0, 10 ** rng.randint(1, 7))
            elif pick < 0.45:
                out[key] = round(rng.uniform(-100, 100), rng.randint(1, 4))
            elif pick < 0.55:
                out[key] = rng.random() < 0.5
            elif pick < 0.7:
                out[key] = [_word(rng) for _ in range(rng.randint(1, 4))]
            else:
                out[key] = " ".join(_word(rng) for _ in range(rng.randint(1, 5)))
        return out

    return json.dumps([record(0) for _ in range(rng.randint(1, 4))], indent=2, ensure_ascii=False)


def _python_source(rng: random.Random) -> str:
    name, arg, acc = _word(rng), _word(rng), _word(rng)
    lines = [
        f"def {name}_{_word(rng)}({arg}, limit={rng.randint(1, 512)}):",
        f'    """{_prose(rng).split(".")[0]}."""',
        f"    {acc} = []",
        f"    for i, item in enumerate({arg}):",
        "        if i >= limit:",
        "            break",
        f"        {acc}.append(item * {rng.randint(2, 99)} + {rng.randint(0, 9)})  # {_word(rng)} {_word(rng)}",
        f"    return {{'{_word(rng)}': {acc}, 'count': len({acc})}}",
    ]
    return "\n".join(lines) + "\n"
