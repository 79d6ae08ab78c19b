"""Which held turn a linear session's request extends (`turns.history`), by the echo digests workers commit."""

from __future__ import annotations

import math
import zlib

from hypothesis import example, given
from hypothesis import strategies as st

from broker.message_keys import DIGEST_FORMAT, EchoDigest, is_first_format, message_key
from gateway_workers.capture.commit_bases import CommitBase
from gateway_workers.turns.history import (
    LinearHistory,
    _extended_heads,
    _local_head,
    _same_message,
    _same_messages,
    echo_flag,
    render_context,
)

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ASKED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find news."}]
REPLY = {
    "role": "assistant",
    "content": "",
    "reasoning": "Search first.",
    "tool_calls": [{"name": "search", "arguments": {"query": "news", "n": 3}}],
}


def _head(turn_id, messages, response, tools=TOOLS):
    n, digest = echo_flag(EchoDigest(render_context(tools), count=len(messages)), response)
    return [turn_id, n, digest]


def _extend(heads, messages, tools=TOOLS):
    """The head the fingerprints say `messages` most likely extends (`_extended_heads`), with `tools`."""
    context = render_context(tools)
    candidates = _extended_heads(heads, messages, context, EchoDigest(context).crc)
    return candidates[0] if candidates else None


def test_a_request_extends_the_turn_it_echoes_whatever_the_client_changed_on_the_way():
    heads = [_head("t0", ASKED, REPLY)]
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [  # no reasoning, call ids, keys reordered
            {"id": "call_1", "type": "function", "name": "search", "arguments": {"n": 3, "query": "news"}}
        ],
    }
    request = [*ASKED, echoed, {"role": "tool", "name": "search", "content": "none"}]
    assert _extend(heads, request) == ("t0", 3)


def test_the_longest_match_wins_and_anything_else_extends_nothing():
    second = [*ASKED, REPLY, {"role": "tool", "content": "none"}]
    answer = {"role": "assistant", "content": "Nothing new."}
    heads = [_head("t1", second, answer), _head("t0", ASKED, REPLY)]
    follow = [*second, answer, {"role": "user", "content": "Thanks."}]
    assert _extend(heads, follow) == ("t1", 5)
    # a sibling of t1 (t0's reply, then another tool result) extends only t0
    sibling = [*ASKED, REPLY, {"role": "tool", "content": "x"}]
    assert _extend(heads, sibling) == ("t0", 3)
    assert _extend(heads, [*ASKED, REPLY]) is None  # nothing new after it
    assert _extend(heads, follow, None) is None  # other tools: the tail cannot follow
    assert _extend([], follow) is None
    other_reply = {"role": "assistant", "content": "Other."}
    assert _extend(heads, [*ASKED, other_reply, {"role": "user", "content": "x"}]) is None
    # The fingerprint is the tools' and the reply's: an edit before the reply is for the comparison to find,
    # once the held turn is at hand (`LinearHistory.prompt`)
    edited = [ASKED[0], {"role": "user", "content": "Find old news."}, REPLY, {"role": "tool", "content": "x"}]
    assert _extend(heads, edited) == ("t0", 3) and not _same_messages(edited, [*ASKED, REPLY])


def test_a_commits_fingerprint_is_its_tools_and_its_reply_and_the_next_request_finds_it():
    request = [*ASKED, REPLY, {"role": "tool", "content": "none"}]
    answer = {"role": "assistant", "content": "Nothing new."}
    context = render_context(TOOLS)
    echo = EchoDigest(crc=EchoDigest(context).crc, count=len(request))  # what `LinearHistory.prompt` gives
    flag = echo_flag(echo, answer)
    assert flag == [5, EchoDigest(context).add([answer]).hexdigest()] and flag[1].endswith(DIGEST_FORMAT)
    assert echo_flag(echo, answer) == flag  # the digest it continues is left as it was
    follow = [*request, {"role": "assistant", "content": " Nothing new. ", "reasoning": "dropped"},
              {"role": "user", "content": "ok"}]  # fmt: skip
    assert _extend([["t1", *flag]], follow) == ("t1", 5)


def test_a_head_recorded_in_the_first_digest_format_is_still_extended():
    """A broker's log or image from before the fingerprints were the tools' and the reply's holds 8-digit
    fingerprints of every message, every part whole: such a head is compared in its own format."""
    long_result = {"role": "tool", "content": "line\n" * 200}
    asked = [*ASKED, REPLY, long_result]
    answer = {"role": "assistant", "content": "Nothing new."}
    old_n, old_digest = echo_flag(EchoDigest(render_context(TOOLS), whole=True).add(asked), answer)
    assert len(old_digest) == 8 and old_digest != _head("t0", asked, answer)[2]
    heads = [["t1", 2, _head("t1", ASKED[:1], ASKED[1])[2]], ["t0", old_n, old_digest]]
    request = [*asked, answer, {"role": "user", "content": "More."}]
    assert _extend(heads, request) == ("t0", 5)
    edited = [*asked[:-1], {"role": "tool", "content": "line\n" * 199 + "lime\n"}, answer, request[-1]]
    assert _extend(heads, edited) == ("t1", 2)  # all of it, every part whole
    assert _extend(heads, request, None) is None  # and the tools


def test_a_long_part_is_fingerprinted_by_its_length_and_ends():
    """Only a candidate: the match is confirmed by comparing the messages (`_same_messages`)."""
    reply = "a" * 200 + "b" * 200 + "c" * 200
    heads = [_head("t0", ASKED, {"role": "assistant", "content": reply})]

    def extends(text: str) -> bool:
        request = [*ASKED, {"role": "assistant", "content": text}, {"role": "user", "content": "go"}]
        return _extend(heads, request) is not None

    assert extends(reply) and extends(reply.replace("bb", "xx")), "a middle edit is the comparison's to find"
    assert not extends(reply[:-1] + "d") and not extends("d" + reply[1:]) and not extends(reply + "c")
    edited = {"role": "assistant", "content": reply.replace("bb", "xx")}
    assert not _same_messages([*ASKED, edited, {"role": "user", "content": "go"}],
                              [*ASKED, {"role": "assistant", "content": reply}])  # fmt: skip


def test_the_head_committed_here_is_matched_by_comparing_messages_and_its_digest_continued():
    base = CommitBase("t0", b"", [*ASKED, REPLY])
    call = {"name": "search", "arguments": {"n": 3, "query": "news"}}
    echoed = {"role": "assistant", "content": "", "tool_calls": [call]}  # reasoning dropped, keys reordered
    request = [*ASKED, echoed, {"role": "tool", "content": "none"}]
    context = render_context(TOOLS)
    heads = [_head("t0", ASKED, REPLY)]
    assert _local_head(base, ("t0", context), heads, request, context) == _extend(heads, request) == ("t0", 3)
    # anything it cannot vouch for is left to the fingerprints
    assert _local_head(base, ("t0", render_context(None)), heads, request, context) is None  # prompted with other tools
    assert _local_head(base, ("t9", context), heads, request, context) is None  # a later turn prompted here
    assert _local_head(None, ("t0", context), heads, request, context) is None  # nothing committed here
    assert _local_head(base, ("t0", context), [_head("t1", ASKED, REPLY)], request, context) is None  # not a head
    assert _local_head(base, ("t0", context), heads, [*ASKED, REPLY], context) is None  # nothing new
    edited = [ASKED[0], {"role": "user", "content": "Find old news."}, REPLY, {"role": "tool", "content": "x"}]
    assert _local_head(base, ("t0", context), heads, edited, context) is None
    # another worker committed a longer line of the session: the fingerprints pick between the two
    longer = [*request, {"role": "assistant", "content": "Nothing."}]
    follow = [*longer, {"role": "user", "content": "ok"}]
    both = [_head("t1", request, longer[-1]), *heads]
    assert _local_head(base, ("t0", context), both, follow, context) is None
    assert _extend(both, follow) == ("t1", 5)


def test_equal_dicts_with_other_json_are_keyed_not_taken_as_echoes():
    """1 == 1.0 == True, so a re-serialised argument compares equal as a dict but is another message to the keys
    (and to the fingerprint other workers check): the head committed here is not matched by it either."""
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "search", "arguments": {"x": 1.0, "ok": True}}],
    }
    echoed = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"x": 1, "ok": 1}}]}
    assert echoed == reply
    base = CommitBase("t0", b"", [*ASKED, reply])
    request = [*ASKED, echoed, {"role": "tool", "content": "none"}]
    context = render_context(TOOLS)
    heads = [_head("t0", ASKED, reply)]
    assert _local_head(base, ("t0", context), heads, request, context) is None
    assert _extend(heads, request) is None


_scalar = st.sampled_from([0, 1, 1.0, True, False, None, math.nan, math.inf, "1", "", 2**70])
_args = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.one_of(_scalar, st.lists(_scalar, max_size=2)), max_size=3)


# What no key holds: the reasoning a client drops on echo, a name it adds (any JSON, as a body may hold)
_unkeyed = st.fixed_dictionaries({}, optional={"reasoning": st.sampled_from(["Think.", "", None]), "name": _scalar})
_roles = st.sampled_from(["assistant", "tool", 1, True, None])


@given(_args, _args, st.booleans(), st.sampled_from(["", " x ", None]), _unkeyed, _unkeyed, _roles, _roles)
def test_same_message_is_the_keys_verdict_however_it_gets_there(first, second, reorder, content, extra, other,
                                                                 role, other_role):  # fmt: skip
    """The shortcut for messages whose role, content and calls compare equal says yes only where the keys would
    (1, 1.0 and True apart, as arguments or as roles; NaN against null; integers orjson cannot write), whatever
    unkeyed fields either side holds."""

    def call(arguments, role, extra):
        if reorder:
            arguments = dict(reversed(list(arguments.items())))
        return {"role": role, "content": content, "tool_calls": [{"name": "f", "arguments": arguments}], **extra}

    a = {"role": role, "content": content, "tool_calls": [{"name": "f", "arguments": first}], **extra}
    for b in (call(first, role, other), call(second, role, other), call(first, other_role, extra)):
        assert _same_message(a, b) == (message_key(a) == message_key(b))


_content = st.sampled_from(["x", " x ", None, [1], [1.0], [True], [{"type": "text", "text": "x"}]])


_side = st.tuples(_roles, _content, _args, st.booleans(), _unkeyed)  # role, content, arguments, calls, extras


@given(st.lists(st.tuples(_side, _side, st.booleans()), min_size=1, max_size=3))
def test_same_messages_is_the_keys_verdict_message_by_message(pairs):
    """The whole-list shortcut (equal lists, one orjson call per side for the tool calls) and the one per message say
    yes exactly where every message's keys agree: a type hidden in an equal list (1 against 1.0 or True; text
    against other content) is caught, a reordered argument still matches through the keys, and fields no key
    holds (the reasoning, a name) are ignored."""

    def message(side, reorder=False):
        role, content, arguments, calls, extra = side
        m = {"role": role, "content": content, **extra}
        if calls:
            m["tool_calls"] = [{"name": "f", "arguments": dict(reversed(list(arguments.items())))
                                if reorder else arguments}]  # fmt: skip
        return m

    def text_role(side):  # canonical roles are text (the adapters admit no other): `_same_message` checks them
        role, *rest = side
        return (role if isinstance(role, str) else "assistant", *rest)

    pairs = [(text_role(first), text_role(second), reorder) for first, second, reorder in pairs]
    held = [message(first) for first, _, _ in pairs]
    for request in (held, [message(first, reorder) for first, _, reorder in pairs],
                    [message(second, reorder) for _, second, reorder in pairs]):  # fmt: skip
        expected = all(message_key(a) == message_key(b) for a, b in zip(request, held, strict=True))
        assert _same_messages([*request, {"role": "user", "content": "next"}], held) == expected
    assert not _same_messages(held, held)  # a request must add a message


def test_only_the_messages_past_the_held_objects_themselves_are_compared():
    """A request parsed from its predecessor's parse holds the held turn's own message objects at its start
    (`_identical`); what follows them is still compared, key for key."""
    held = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "search", "arguments": {"n": 1}}]}, {"role": "tool", "content": "r"}]
    new = {"role": "user", "content": "next"}
    assert _same_messages([*held, new], held)  # all of them the held objects
    echo = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"n": 1}}]}
    assert _same_messages([held[0], echo, held[2], new], held)  # an equal echo past the first
    for other in ({"n": 1.0}, {"n": True}, {"n": 2}):  # keyed apart
        changed = {**echo, "tool_calls": [{"name": "search", "arguments": other}]}
        assert not _same_messages([held[0], changed, held[2], new], held), other
    assert not _same_messages([held[0], held[1], {"role": "tool", "content": "other"}, new], held)


def test_values_that_compare_equal_but_key_apart_never_match():
    """1 == 1.0 == True wherever a key holds it (a content, an argument, a role), and null where orjson writes NaN:
    each shortcut, the one for equal lists, the one field by field and the one per message, must tell them
    apart as the keys do."""

    def message(role="assistant", content="x", argument=1):
        return {"role": role, "content": content, "tool_calls": [{"name": "f", "arguments": {"a": argument}}]}

    assert not _same_message(message(role=True), message(role=1))  # canonical roles are text, but not here
    for held, echoed in [
        (message(content=[1]), message(content=[1.0])),
        (message(argument=1), message(argument=1.0)),
        (message(argument=True), message(argument=1)),
        (message(argument=None), message(argument=math.nan)),  # orjson writes NaN and infinities as null
        (message(argument=None), message(argument=math.inf)),
    ]:
        assert message_key(held) != message_key(echoed)
        assert not _same_message(echoed, held)
        for extra in ({}, {"reasoning": "only the held reply kept it"}):  # equal lists, then equal fields
            assert not _same_messages([{**echoed}, {"role": "user", "content": "next"}], [{**held, **extra}])


def test_a_tie_between_heads_goes_to_the_fingerprints():
    """Two continuations of one turn with the same keys (the same call, other reasoning): the newest wins, as
    the fingerprints decide it, not the one committed here."""
    base = CommitBase("t1", b"", [*ASKED, REPLY])
    request = [*ASKED, REPLY, {"role": "tool", "content": "none"}]
    context = render_context(TOOLS)
    heads = [_head("t2", ASKED, REPLY), _head("t1", ASKED, REPLY)]  # newest first
    assert _local_head(base, ("t1", context), heads, request, context) is None
    assert _extend(heads, request) == ("t2", 3)


_json_scalar = st.sampled_from([0, 1, 1.0, True, False, None, "1", "", 2**70, 0.1, -0.0])  # what a JSON body holds
_schemas = st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(_json_scalar, st.lists(_json_scalar, max_size=2)))


@given(st.lists(st.lists(_schemas, max_size=2), min_size=1, max_size=12))
def test_each_tool_set_gets_its_own_context_however_often_it_is_seen(tool_sets):
    """The tools context is kept by the tools' orjson text: what the digest gets is always `render_context`'s,
    and its CRC, for tool sets that compare equal but write other JSON (1, 1.0, True) too."""
    history = LinearHistory(None, None, ())  # the contexts need neither a backplane nor a renderer
    for schemas in [*tool_sets, *tool_sets]:
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}} for schema in schemas]
        context = render_context(tools or None)
        assert history._tools_context(tools or None) == (context, EchoDigest(context).crc)


_text = st.text(alphabet=st.sampled_from(["a", " ", "é", "\n", "\ud800", "<"]), max_size=6)
# Canonical messages, and whatever else a key is made of: other roles and contents (the digest's short way for
# text messages must give what the keys give), calls of every shape, messages that are no dicts.
_call = st.one_of(
    st.fixed_dictionaries({"name": _text, "arguments": st.one_of(_args, _text, st.just('{"b": 1, "a": [2]}'))}),
    st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": _text, "arguments": _text})}),
    st.sampled_from(["raw", 1, None]),
)
_message = st.one_of(
    st.fixed_dictionaries(
        {"content": st.one_of(st.none(), _text, _text.map(lambda t: f"{t}</think>{t}"),
                              st.sampled_from([0, False, 1.5, [], {}, [{"type": "text", "text": " x "}], ["y"]]))},
        optional={
            "role": st.sampled_from(["user", "assistant", "tool", "system", "developer", "", 1, None]),
            "tool_calls": st.one_of(st.lists(_call, max_size=2), st.sampled_from([None, [], "x", {"name": "a"}])),
        },
    ),
    st.sampled_from(["text", 1, None, ["x"]]),
)


# Texts and arguments either side of the length past which the digest writes only their ends
_long = st.builds(lambda a, n, b: a + "x" * n + b, _text, st.integers(240, 272), _text)
_long_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.one_of(_text, _long)},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"name": _text, "arguments": st.one_of(_text, _long)}),
                                     max_size=2)},
)


@given(st.text(max_size=8), st.lists(st.one_of(_message, _long_message), max_size=4), st.integers(0, 4), st.booleans())
@example("", [{"role": "assistant", "content": "Hmm.</think> Done."}, {"role": "user", "content": 0}], 1, False)
@example("", [{"role": "tool", "content": "é" * 257}, {"role": "user", "content": " " + "a" * 256 + " "}], 1, False)
def test_the_echo_digest_is_the_checksum_of_each_part_after_its_length(context, messages, split, whole):
    """What workers commit and others compare (kept in the broker's log): CRC-32 over the context, then per
    message each key part after its length (8 bytes, little-endian) and its number of calls, whatever the
    batches the messages are added in. A text or arguments past 256 characters: its length in characters with
    the top bit set, then its first and last 128 (in the first format, `whole`, every part whole)."""
    crc = zlib.crc32(context.encode("utf-8", "surrogatepass"))
    for m in messages:
        role, content, calls = message_key(m)
        parts = [(role, False), (content, True)]
        for call in calls:
            parts += [(call[0], False), (call[1], True)] if isinstance(call, tuple) else [(call, False)]
        for part, may_cut in parts:
            if may_cut and len(part) > 256 and not whole:
                length, data = (len(part) | 1 << 63), (part[:128] + part[-128:]).encode("utf-8", "surrogatepass")
            else:
                data = part.encode("utf-8", "surrogatepass")
                length = len(data)
            crc = zlib.crc32(data, zlib.crc32(length.to_bytes(8, "little"), crc))
        crc = zlib.crc32(len(calls).to_bytes(8, "little"), crc)
    digest = EchoDigest(context, whole=whole).add(messages[:split]).add(messages[split:])
    assert (digest.crc, digest.count) == (crc, len(messages))
    assert digest.hexdigest() == f"{crc:08x}" + ("" if whole else DIGEST_FORMAT)
    assert is_first_format(digest.hexdigest()) == whole
