"""One sample of every wire message, per direction, and helpers the protocol and codec tests share.

`MESSAGES` covers every class of every direction's union (test_protocol checks that); `ALL` flattens
it; `unpacked` turns a decoded CommitTurn's packed messages back into dicts; `_values` draws the
msgpack values a random frame may hold.
"""

from __future__ import annotations

import dataclasses
from array import array

from hypothesis import strategies as st

from broker import protocol
from broker.protocol import (
    AbortTurn,
    CommitTurn,
    DeliveredEpisode,
    DropSession,
    EnginesSet,
    EpisodesDelivered,
    FetchEpisodes,
    FinishAccepted,
    FinishSession,
    GenerationChanged,
    GenerationPaused,
    GenerationResumed,
    GenerationState,
    GetGeneration,
    GetMetrics,
    GetStats,
    GetTurn,
    Heartbeat,
    MetricsText,
    OpenSession,
    OpenTurn,
    PauseGeneration,
    Refused,
    RequestFinish,
    ResumeGeneration,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionsEnded,
    SetEngines,
    SetWeightVersion,
    Stats,
    TraceRow,
    TurnAborted,
    TurnCommitted,
    TurnFound,
    TurnOpened,
    TurnReplayed,
    WeightVersionSet,
)

IDS = protocol.ids_array([1, 151_643, 0, 2**31 - 1, -1])
LPS = protocol.logprobs_array([-0.5, 0.0, -12.25, -1e-6, -3.0])

MESSAGES: dict[str, list] = {
    "worker_to_broker": [
        OpenTurn(1, "sess", "turn-1"),
        CommitTurn(
            2,
            "sess",
            "turn-1",
            IDS,
            IDS[:2],
            LPS[:2],
            "stop",
            [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo ✓"}],
            {
                "role": "assistant",
                "content": "",
                "reasoning": "r",
                "tool_calls": [{"name": "f", "arguments": {"b": 1, "a": [1, 2]}}],
            },
            {"ill_formed": False},
            {"engine_s": 0.25},
        ),
        CommitTurn(
            3,
            "sess",
            "empty",
            protocol.ids_array(),
            protocol.ids_array(),
            protocol.logprobs_array(),
            "length",
            [],
            {"role": "assistant", "content": ""},
        ),
        AbortTurn(4, "sess", "turn-2", "client_disconnect"),
        GetTurn(21, "sess", "turn-1"),
        GetTurn(22, "sess", ""),
        GetTurn(30, "sess", "turn-1", True),
        Heartbeat(0, "host:123:beef"),
        Heartbeat(0, "host:123:beef", {"seq": 3, "pid": 123, "counters": [["turns", ["chat", "false", "committed"], 2]],
                                       "histograms": [], "gauges": [["render_cache_pieces", [], 7]]}),
        GetMetrics(34, "host:123:beef", {"seq": 4, "pid": 123, "counters": [], "histograms": [], "gauges": []}),
        Heartbeat(0, "host:123:beef", {}, [3, 0, 2, 117, 1]),
        OpenTurn(23, "sess", "turn-2", "host:123:beef"),
        OpenTurn(24, "sess", "turn-3", "host:123:beef", "0f" * 16, True),
        RequestFinish(24, "sess", 0.5, None, {"judge": "harness"}, 5.0),
    ],
    "broker_to_worker": [
        TurnOpened(5, "turn-1", 7, {"temperature": 1.0, "stop": ["x"]}, 32_768),
        TurnOpened(6, "turn-1", 0, {}, None),
        TurnOpened(31, "turn-3", 2, {}, None, "linear", "fork", [["turn-2", 4, "ab" * 16], ["turn-1", 2, "cd"]], 1),
        TurnOpened(37, "turn-4", 3, {}, None, "tree", "", [], 0, 12),
        TurnOpened(39, "turn-5", 4, {}, None, "tree", "", [], 0, -1, "http://10.0.0.1:8000"),
        TurnOpened(40, "turn-6", 5, {}, None, "tree", "", [], 0, 3, "", 7, "abort"),
        TurnCommitted(7, "turn-1", "stored"),
        TurnAborted(8, "turn-2"),
        Refused(9, "turn_cap", "no more"),
        TurnFound(
            23,
            "turn-1",
            [{"role": "user", "content": "héllo"}],
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]},
        ),
        TurnFound(32, "turn-1", [{"role": "user", "content": "h"}], {"role": "assistant", "content": ""}, IDS, IDS[:1]),
        FinishAccepted(25, "sess"),
        TurnReplayed(26, "turn-1", IDS, IDS[:2], "stop", {"role": "assistant", "content": "again"}, {"x": False}),
        SessionsEnded(0, ["sess", "other"]),
        SessionsEnded(0, []),
        GenerationChanged(0, 7, "abort", 3),
        GenerationChanged(0, 9, "keep", 3, ["host:1:aa", "host:2:bb"]),
        GenerationChanged(0, 8, ""),
        MetricsText(34, "# HELP x y\nx 1.0\n"),
    ],
    "trainer_to_broker": [
        OpenSession(10, None, {"temperature": 0.5}, None, 8, {"task": "gsm8k"}),
        OpenSession(11, "given-key", {}, 4096, None),
        FinishSession(12, "sess", 1.0, "ep-7", {"k": [1, "v"]}, 5.0),
        FinishSession(13, "sess", None, None, {}, 0.0),
        DropSession(14, "sess"),
        GetStats(15),
        GetMetrics(35),
        SetWeightVersion(36, 7),
        SetEngines(38, ["http://10.0.0.1:8000", "https://e2"]),
        PauseGeneration(40, "abort", 30.0),
        ResumeGeneration(41, 8),
        ResumeGeneration(42),
        GetGeneration(43),
        OpenSession(26, None, {}, None, None, {}, "client-1", "step-3"),
        OpenSession(33, None, {}, None, None, {}, "client-1", None, "linear", "reject"),
        RequestFinish(27, "sess", None, "ep-8", {}, 0.0),
        FetchEpisodes(28, "sub-1", "", 4, [], [], [], 1.0, 30.0, None, None),
        FetchEpisodes(29, "sub-1", "e" * 16, 0, [1, 2], [3, 2**40], [5], 0.0, 0.5, "client-1", "step-3"),
    ],
    "broker_to_trainer": [
        SessionOpened(16, "rg-abc"),
        SessionFinished(
            17,
            "sess",
            [
                TraceRow(IDS, array("B", [1, 0, 1]), LPS[:3], 3, "text", "ep-7", 1.0, "completed", {"use_tool": True}),
                TraceRow(IDS[:1], array("B", [1]), LPS[:1], 1, "", None, None, "truncated", {}, IDS[:1]),
            ],
            "complete",
            2,
            0,
        ),
        SessionFinished(18, "sess", [], "drain_timeout", 0, 3),
        SessionDropped(19, "sess", True),
        Stats(20, {"sessions_open": 3, "refusals": {"protocol": 1}}),
        Refused(-1, "protocol", "garbage"),
        MetricsText(35, ""),
        WeightVersionSet(36, 7, -1),
        EnginesSet(38, ["http://10.0.0.1:8000"]),
        GenerationPaused(40, "abort", True, False, 0.25, 2, 0, 5, 1234),
        GenerationResumed(41, True, 12.5, 8),
        GenerationState(43, "wait", 1.7e9),
        GenerationState(44, "", 0.0),
        FinishAccepted(30, "sess"),
        EpisodesDelivered(31, "e" * 16, [], [], 0),
        EpisodesDelivered(
            32,
            "e" * 16,
            [
                DeliveredEpisode(
                    7,
                    "sess",
                    [TraceRow(IDS, array("B", [1, 0, 1]), LPS[:3], 3, "t", "ep-7", 1.0, "completed", {})],
                    1.0,
                    "ep-7",
                    {"task": "x"},
                    "complete",
                    False,
                    "step-3",
                    "trainer",
                    2,
                    0,
                ),
                DeliveredEpisode(8, "s2", [], None, None, {}, "failed", True, None, "agent", 0, 1),
            ],
            [4, 5],
            2,
        ),
    ],
}
DECODERS = {direction: getattr(protocol, f"decode_{direction}") for direction in MESSAGES}
ALL = [(direction, m) for direction, msgs in MESSAGES.items() for m in msgs]



def unpacked(msg: protocol.Message) -> protocol.Message:
    """`msg` with a CommitTurn's packed messages (bytes, as decoded) as dicts again."""
    if not isinstance(msg, CommitTurn):
        return msg
    prompt = [m if isinstance(m, dict) else protocol.unpack_messages(m)[0] for m in msg.prompt_messages]
    response = msg.response_message
    return dataclasses.replace(
        msg,
        prompt_messages=prompt,
        response_message=response if isinstance(response, dict) else protocol.unpack_messages(response)[0],
    )


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=10,
)
