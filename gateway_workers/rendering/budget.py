"""Context budgets: proving a prompt too long before it is tokenized in full.

A session's `max_context_tokens` turns a prompt that reaches it into an empty `length` turn, so its ids
are never needed: tokenizing a hostile 16 MiB prompt would only hold the render thread for seconds.
Two proofs, both exact lower bounds on the full encode's length:
- by size: no token covers more than `max_token_bytes` bytes of the normalized text, so a text of B
  bytes takes at least ceil(B / max_token_bytes) tokens (`TokenBound.at_least`);
- by counting: the renderer encodes a prompt's pieces (cut at added tokens, each encoded on its own)
  in batches and stops once the ids so far exceed the budget (`Renderer._assemble`).
Imports only the stdlib; must not import the renderer, the app, adapters or engines.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from typing import Any


class PromptOverBudget(Exception):
    """The prompt has at least `at_least` tokens, more than the `budget` it was rendered for (no ids exist)."""

    def __init__(self, at_least: int, budget: int) -> None:
        super().__init__(f"the prompt has at least {at_least} tokens; the context budget is {budget}")
        self.at_least = at_least
        self.budget = budget


class TokenBound:
    """A lower bound on a text's token count from its size, for one tokenizer.

    Args:
        max_token_bytes: the most bytes of normalized text one token covers (its longest token), or
            0 where no size bound holds (then `at_least` is always 0).
        nfc: the tokenizer normalizes to NFC first, which may shorten the text (composition).
    """

    def __init__(self, max_token_bytes: int, nfc: bool = False) -> None:
        self.max_token_bytes = max_token_bytes
        self.nfc = nfc

    def at_least(self, text: str, budget: int) -> int:
        """A proven lower bound on the tokens of `text` when it exceeds `budget`, else 0 (nothing proven).

        The UTF-8 length is linear and cheap; NFC is applied only when it could change the text and the
        raw size alone would already prove the budget exceeded.
        """
        most = self.max_token_bytes
        if not most or len(text) <= budget:  # a character is at least a byte: nothing to prove
            return 0
        size = len(text.encode("utf-8", "surrogatepass"))
        if -(-size // most) <= budget:
            return 0
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            size = len(unicodedata.normalize("NFC", text).encode("utf-8", "surrogatepass"))
        bound = -(-size // most)
        return bound if bound > budget else 0


def token_bound(backend: Any, byte_table: Sequence[bytes] | None) -> TokenBound:
    """The size bound of a `tokenizers.Tokenizer` (`backend`): its longest token in bytes of normalized text.

    A byte-level vocabulary's `byte_table` gives each token's bytes exactly. Otherwise a token's own
    spelling is at least as long as the text it covers (Metaspace's "▁" stands for one space, a
    byte-fallback "<0x0A>" for one byte). Normalizers other than NFC (lowercasing, replacements) could
    shorten the text by rules not modelled here: no size bound then.
    """
    if backend is None:
        return TokenBound(0)
    normalizer = backend.normalizer
    kind = None if normalizer is None else json.loads(normalizer.__getstate__()).get("type")
    if kind not in (None, "NFC"):
        return TokenBound(0)
    if byte_table is not None:
        most = max(map(len, byte_table), default=0)
    else:
        most = max((len(token.encode("utf-8")) for token in backend.get_vocab(with_added_tokens=True)), default=0)
    return TokenBound(most, nfc=kind == "NFC")
