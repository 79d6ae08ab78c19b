"""Policy versions on every token: `set_weight_version` mid-episode, through a real `serve` and its broker.

A real `serve` (2 workers, the fake SGLang engine, which reports its own `meta_info.weight_version`, and a
durable broker); an agent on the official openai SDK runs one linear-history conversation of four turns
while the trainer sets version 3 before the first and 4 before the third, and the engine is told to serve
"step-3" then "step-4". The episode's row carries, per response token, the version of the turn that sampled it (-1 for
context), the turns' min and max, and the engine's own version per turn. The version survives the
broker's `kill -9` (it is in the log), so turns after the restart still record it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import openai
import pytest
from assets import FakeEngine, wait_until
from processes import launch_gateway
from test_serve_durability import RESTART_WITHIN_S, broker_pid


def _ask(gw: Any, sid: str, messages: list[dict[str, Any]], content: str) -> None:
    """One turn of the conversation (a new connection each, so either worker takes it); the reply is echoed."""
    with openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=30,
                       default_headers={"Connection": "close"}) as agent:  # fmt: skip
        messages.append({"role": "user", "content": content})
        reply = agent.chat.completions.create(model="qwen3", messages=messages)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_a_version_set_mid_episode_is_on_every_token_and_survives_a_broker_crash(
    tmp_path: Any, fake_engine: FakeEngine, qwen3_tokenizer_dir: str
) -> None:
    extra = ["--log-level", "warning", "--state-dir", str(tmp_path / "state")]
    with launch_gateway(workers=2, engine_kind="sglang", engine_urls=[fake_engine.url], tokenizer=qwen3_tokenizer_dir,
                        extra_args=extra) as gw:  # fmt: skip
        sid = gw.client.open_session(history_mode="linear")  # one row for the episode: the versions side by side
        messages: list[dict[str, Any]] = []
        assert gw.client.set_weight_version(3) == -1
        fake_engine.configure(weight_version="step-3")
        _ask(gw, sid, messages, "first question")
        _ask(gw, sid, messages, "second question")
        assert gw.client.set_weight_version(4) == 3
        fake_engine.configure(weight_version="step-4")
        _ask(gw, sid, messages, "third question")
        _ask(gw, sid, messages, "fourth question")
        with pytest.raises(ValueError):
            gw.client.set_weight_version(-2)
        records = gw.client.finish_session(sid)
        assert len(records) == 1, [r.metadata for r in records]
        (row,) = records
        meta = row.metadata
        assert (meta["weight_version_min"], meta["weight_version_max"]) == (3, 4)
        assert meta["engine_weight_versions"] == ["step-3", "step-3", "step-4", "step-4"]
        assert len(row.weight_versions) == len(row.loss_mask)
        # context tokens carry -1; the sampled ones their turn's version, in order: 3 for two turns, then 4
        assert all(v == -1 for v, m in zip(row.weight_versions, row.loss_mask, strict=True) if not m)
        sampled = [v for v, m in zip(row.weight_versions, row.loss_mask, strict=True) if m]
        runs = [v for k, v in enumerate(sampled) if k == 0 or sampled[k - 1] != v]
        assert runs == [3, 4] and sampled.count(3) > 0 and sampled.count(4) > 0

        # the version is durable: a killed broker comes back with it, and new turns still record it
        first = broker_pid(gw.process.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
        assert wait_until(lambda: gw.client.stats()["weight_version"] == 4, timeout=RESTART_WITHIN_S)
        later = gw.client.open_session()
        _ask(gw, later, [], "after the restart")
        (after,) = gw.client.finish_session(later)
        assert {v for v, m in zip(after.weight_versions, after.loss_mask, strict=True) if m} == {4}
