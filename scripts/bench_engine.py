"""Benchmark harness: a fake vLLM token-in/token-out engine that costs next to nothing per request.

`python scripts/bench_engine.py --tokenizer DIR --port 0` prints `BENCH ENGINE READY http://HOST:PORT`.
Speaks vLLM's `POST /inference/v1/generate` (plain JSON, or SSE with `stream: true`) on a bare
asyncio + httptools server with keep-alive, so the gateway, not the engine, is what a load test
measures. Every reply is a Qwen3 tool call (`<think>` block optional) whose `query` argument
carries a request serial; the engine records (serial, prompt ids, output ids, logprobs) so the
load generator can check the fidelity rule for what each agent received. Controls:
`GET /_bench/log` (msgpack), `POST /_bench/reset`, `POST /_bench/config` ({"delay_s", "per_token_s", "think"}).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import msgpack
import orjson
from tokenizers import Tokenizer

READY_LINE = "BENCH ENGINE READY"
GENERATE_PATH = b"/inference/v1/generate"
_WORDS = "alpha delta echo golf hotel india mike november uniform whiskey".split()  # one Qwen token each


class Engine:
    """The policy and the request log."""

    def __init__(self, tokenizer: Tokenizer, think: bool, think_words: int, delay_s: float, per_token_s: float) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.token_to_id("<|im_end|>")
        if eos is None:
            raise SystemExit("bench engine: the tokenizer has no <|im_end|> token")
        self.eos: int = eos
        self.think, self.think_words = think, think_words
        self.delay_s, self.per_token_s = delay_s, per_token_s
        self.serial = 0
        self.log: list[tuple[int, bytes, bytes, bytes]] = []  # serial, prompt, output (int32), logprobs (f32)
        self.requests = 0

    def reply(self, prompt: list[int], max_tokens: int) -> tuple[int, list[int], list[float], str]:
        self.serial += 1
        serial = self.serial
        rng = random.Random(serial)
        words = " ".join(rng.choice(_WORDS) for _ in range(self.think_words))
        call = json.dumps({"name": "search", "arguments": {"query": f"q{serial}"}})
        text = f"<tool_call>\n{call}\n</tool_call>"
        if self.think:
            text = f"<think>\nStep {serial}: {words}.\n</think>\n\n" + text
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids + [self.eos]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        logprobs = [-rng.randrange(1, 8192) / 1024.0 for _ in ids]  # exact in float32
        self.log.append(
            (serial, array("i", prompt).tobytes(), array("i", ids).tobytes(), array("f", logprobs).tobytes())
        )
        return serial, ids, logprobs, finish


def _choice(ids: list[int], logprobs: list[float], finish: str | None) -> dict[str, Any]:
    content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]
    return {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: parse with httptools, answer each request in order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.queue: asyncio.Queue[tuple[bytes, bytes, bool] | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.task = asyncio.get_running_loop().create_task(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.respond(400, b'{"error": "bad http"}', keep=False)

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.put_nowait((self.url, b"".join(self.body), self.parser.should_keep_alive()))
        self.url, self.body = b"", []

    async def serve(self) -> None:
        while (item := await self.queue.get()) is not None:
            url, body, keep = item
            try:
                await self.handle(url, body, keep)
            except (ValueError, KeyError, TypeError) as e:
                self.respond(400, orjson.dumps({"error": f"{type(e).__name__}: {e}"}), keep)

    async def handle(self, url: bytes, body: bytes, keep: bool) -> None:
        engine = self.engine
        if url.startswith(GENERATE_PATH):
            request = orjson.loads(body)
            prompt, params = request["token_ids"], request["sampling_params"]
            engine.requests += 1
            serial, ids, lps, finish = engine.reply(prompt, int(params.get("max_tokens", 16)))
            delay = engine.delay_s + engine.per_token_s * len(ids)
            if request.get("stream"):
                await self.stream(ids, lps, finish, delay, keep)
                return
            if delay:
                await asyncio.sleep(delay)
            answer = {
                "request_id": f"generate-tokens-{serial}",
                "choices": [_choice(ids, lps, finish)],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
            self.respond(200, orjson.dumps(answer), keep)
        elif url.startswith(b"/_bench/log"):
            self.respond(200, msgpack.packb(engine.log), keep, b"application/msgpack")
        elif url.startswith(b"/_bench/reset"):
            engine.log.clear()
            engine.requests = 0
            self.respond(200, b"{}", keep)
        elif url.startswith(b"/_bench/config"):
            config = orjson.loads(body or b"{}")
            engine.delay_s = float(config.get("delay_s", engine.delay_s))
            engine.per_token_s = float(config.get("per_token_s", engine.per_token_s))
            engine.think = bool(config.get("think", engine.think))
            self.respond(200, b"{}", keep)
        elif url.startswith(b"/health"):
            self.respond(200, b"{}", keep)
        else:
            self.respond(404, b'{"error": "not found"}', keep)

    async def stream(self, ids: list[int], lps: list[float], finish: str, delay: float, keep: bool) -> None:
        """vLLM's token stream: one event per engine step (here: up to 4 ids), then usage and [DONE]."""
        assert self.transport is not None
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        self.transport.write(head + (b"" if keep else b"connection: close\r\n") + b"\r\n")
        step = 4
        for k in range(0, len(ids), step):
            if delay:
                await asyncio.sleep(delay * step / max(1, len(ids)))
            last = k + step >= len(ids)
            event = {"choices": [_choice(ids[k : k + step], lps[k : k + step], finish if last else None)]}
            self._chunk(b"data: " + orjson.dumps(event) + b"\n\n")
        usage = {"prompt_tokens": 0, "completion_tokens": len(ids), "total_tokens": len(ids)}
        self._chunk(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        self.transport.write(b"0\r\n\r\n")
        if not keep:
            self.transport.close()

    def _chunk(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def respond(self, status: int, body: bytes, keep: bool, kind: bytes = b"application/json") -> None:
        if self.transport is None or self.transport.is_closing():
            return
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Error")
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (status, reason, kind, len(body))
        self.transport.write(head + (b"" if keep else b"connection: close\r\n") + b"\r\n" + body)
        if not keep:
            self.transport.close()


async def serve(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    engine = Engine(
        tokenizer,
        think=not args.no_think,
        think_words=args.think_words,
        delay_s=args.delay,
        per_token_s=args.per_token_delay,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    factory: Callable[[], Connection] = lambda: Connection(engine)  # noqa: E731
    server = await asyncio.get_running_loop().create_server(factory, sock=sock, backlog=4096)
    host, port = sock.getsockname()[:2]
    print(f"{READY_LINE} http://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (Qwen BPE)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds per request")
    p.add_argument("--per-token-delay", type=float, default=0.0, help="extra seconds per generated token")
    p.add_argument("--no-think", action="store_true", help="replies without a <think> block")
    p.add_argument("--think-words", type=int, default=24, help="words of reasoning per reply")
    args = p.parse_args()
    started = time.time()
    try:
        try:
            import uvloop
        except ImportError:  # the stdlib loop works too, just slower
            asyncio.run(serve(args))
        else:
            uvloop.run(serve(args))
    except KeyboardInterrupt:
        print(f"bench engine stopped after {time.time() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
