"""Echo keys: what of a canonical message (see `protocol.CommitTurn`) survives a client's echo of it.

Agents send earlier replies back with their own changes: reasoning dropped or inlined, tool-call ids and
`name` added, argument keys reordered, whitespace trimmed. Two messages with the same key are the same
message. The trajectory builder labels rows by these keys (`broker.episodes.trajectory`), and a worker
judges by them whether a request extends a linear session's held turn (`gateway_workers.turns.history`),
against the `echo` digest its committing worker recorded: both sides must normalise alike, so the rule is
written once, here. Stdlib only, nothing else of `broker`; workers may import it.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

MessageKey = tuple[Any, ...]
_LENGTH = struct.Struct("<Q").pack  # a key part's length, as the digest writes it
# The canonical roles' parts, each after its length; and the last parts of a message without calls, whose key
# holds ("?",) in their place (`message_key`), and their number, 1.
_ROLE_PARTS = {role: _LENGTH(len(role)) + role.encode() for role in ("system", "user", "assistant", "tool")}
_NO_CALLS = _LENGTH(1) + b"?" + _LENGTH(1)
# A text or arguments longer than 2 * _ENDS characters is written as its length in characters, marked, and its
# first and last _ENDS characters: a fingerprint only picks a candidate, and the CRC of a long tool result was
# most of what a turn's digest cost (docs/performance.md).
_ENDS = 128
_CUT = 1 << 63
_WHOLE = 1 << 62  # longer than any part: the first format cut none
# What ends every fingerprint of this format (`EchoDigest.hexdigest`). The first format wrote every part whole
# and had no ending: a broker's log or image from before may hold such heads (`first_format_digests`).
DIGEST_FORMAT = "/2"

# What json.dumps(value, sort_keys=True, separators=(",", ":"), default=str) builds on every call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)


def _canonical_writer() -> Callable[[Any], str]:
    """`_CANONICAL.encode` without its per-call cost: `JSONEncoder.encode` makes the stdlib's C encoder afresh on
    every call, which is most of what a tool call's arguments cost to key. Made once here, with the arguments
    `encode` gives it (no circular-reference check: the values are decoded JSON); where the C encoder is
    missing or refuses them, `encode` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    try:
        write = make(None, str, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True)
    except TypeError:  # None (no C accelerator) or another signature
        return _CANONICAL.encode
    return lambda value: "".join(write(value, 0))


_write_canonical = _canonical_writer()


def message_key(m: Any) -> MessageKey:
    """Normalise what clients drop or add on echo: reasoning, tool-call ids, `name`, argument key order, whitespace."""
    if not isinstance(m, dict):
        return ("?", _text(m), ())
    role = str(m.get("role", ""))
    content = _text(m.get("content"))
    if role == "assistant" and "</think>" in content:
        # Some clients echo the reasoning inline; the reply we parsed kept it apart.
        content = content.rsplit("</think>", 1)[1].strip()
    calls = m.get("tool_calls") or ()
    return (role, content, tuple(_call_key(c) for c in calls) if isinstance(calls, list) else ("?",))


class EchoDigest:
    """A running fingerprint of a context string and the keys of the messages added to it, in order.

    `context` is what else must match for two prompts to continue alike (a linear session: the tools). A
    fingerprint picks a candidate, it proves nothing: a linear match is confirmed by comparing the keys with
    the held turn's messages (`gateway_workers.turns.history`). CRC-32 over length-prefixed parts, a long part
    by its length and ends: a fraction of a cryptographic hash's instructions, no escaping pass over long
    contents, and a cost per message that does not grow with its text (docs/performance.md).
    """

    __slots__ = ("crc", "count", "whole")

    def __init__(self, context: str = "", crc: int | None = None, count: int = 0, whole: bool = False) -> None:
        self.crc = crc if crc is not None else zlib.crc32(context.encode("utf-8", "surrogatepass"))
        self.count = count  # messages it stands for: those added, and those `crc` was given for
        self.whole = whole  # the first format: every part whole, no DIGEST_FORMAT

    def add(self, messages: Sequence[Any]) -> EchoDigest:
        """Each message's key parts, each after its length (8 bytes, little-endian), then its number of calls:
        joined and checksummed in one call (CRC-32 continues across concatenation, so the digest is the
        part-by-part one, at one call's cost instead of two per part). A text or a call's arguments longer than
        2 * _ENDS characters is written as its length in characters with the top bit set and its first and
        last _ENDS characters (`_ends`). A dict of text and a list of calls, nearly every message, takes a
        short way to its key's parts."""
        chunks: list[bytes] = []
        longest = _WHOLE if self.whole else 2 * _ENDS
        for m in messages:
            role = content = calls = None
            if type(m) is dict:
                role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
                if content is None:
                    content = ""
            if (type(role) is str and type(content) is str and (not calls or type(calls) is list)
                    and (role != "assistant" or "</think>" not in content)):
                text, keyed = content.strip(), map(_call_key, calls) if calls else None
            else:
                role, text, calls = message_key(m)
                keyed = None if calls == ("?",) else calls  # None: no calls, which the key writes as ("?",)
            head = _ROLE_PARTS.get(role)
            if head is None:
                r = role.encode("utf-8", "surrogatepass")
                head = _LENGTH(len(r)) + r
            if len(text) > longest:
                chunks.append(head)
                chunks += _ends(text)
            else:
                c = text.encode("utf-8", "surrogatepass")
                chunks += (head, _LENGTH(len(c)), c)
            if keyed is None:
                chunks.append(_NO_CALLS)
                continue
            for name, arguments in keyed:
                n = name.encode("utf-8", "surrogatepass")
                if len(arguments) > longest:
                    chunks += (_LENGTH(len(n)), n, *_ends(arguments))
                else:
                    a = arguments.encode("utf-8", "surrogatepass")
                    chunks += (_LENGTH(len(n)), n, _LENGTH(len(a)), a)
            chunks.append(_LENGTH(len(calls)))
        self.crc, self.count = zlib.crc32(b"".join(chunks), self.crc), self.count + len(messages)
        return self

    def copy(self) -> EchoDigest:
        return EchoDigest(crc=self.crc, count=self.count, whole=self.whole)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}" if self.whole else f"{self.crc:08x}{DIGEST_FORMAT}"


def is_first_format(digest: Any) -> bool:
    """Whether `digest` is a fingerprint of the first format (`first_format_digests`)."""
    return type(digest) is str and len(digest) == 8


def _ends(part: str) -> tuple[bytes, bytes]:
    """A long part as the digest writes it: its length in characters with the top bit set, and its ends."""
    return _LENGTH(len(part) | _CUT), (part[:_ENDS] + part[-_ENDS:]).encode("utf-8", "surrogatepass")


def first_format_digests(context: str, messages: Sequence[Any], at: Sequence[int]) -> dict[int, str]:
    """The first format's fingerprint of each head with n messages, for each n in `at`: the digest of `context`
    and all of `messages[:n]`, every part whole. One pass over them, whatever `at` holds."""
    digest, out = EchoDigest(context, whole=True), {}
    for n in sorted({n for n in at if type(n) is int and 0 <= n <= len(messages)}):
        digest.add(messages[digest.count : n])
        out[n] = digest.hexdigest()
    return out


def canonical_json(value: Any) -> str:
    """Stable text of a JSON-like value (sorted keys, no spaces); repr where keys cannot be sorted."""
    try:
        return _write_canonical(value)
    except (TypeError, ValueError):  # mixed-type keys cannot be sorted: any stable text will do
        return repr(value)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):  # content parts, should a non-canonical message slip through
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content).strip()
    return canonical_json(content)


def _call_key(call: Any) -> tuple[str, str]:
    if not isinstance(call, dict):
        return ("?", _text(call))
    fn: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return (str(fn.get("name", "")), args.strip())
    return (str(fn.get("name", "")), canonical_json(args))
