"""What each coding harness puts in its prompt, turn by turn: system text, tools, reminders, and the prompt's tokens.

Runs every harness of `tests/coding_harnesses.py` (installed by scripts/run_tests.sh) once against `serve` on the
test fake engine (two tool rounds, then an answer), through a small recording proxy, and prints one row per
request: the characters of its system text (system prompt, system and developer messages), of its tool
definitions (as sent) and of the text the harness adds to user turns in tags (`<system-reminder>`,
`<environment_context>`, ...), the number of tools, and the prompt's tokens as the gateway rendered them
(the reply's usage). Use it to see what a harness costs per turn before training on it:

    .venv-test/bin/python scripts/harness_prompts.py [--harness NAME ...] [--env NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the harness definitions and the fake engine the tests use
sys.path.insert(0, str(ROOT))

from assets import FakeEngine, trl_qwen3_template_path  # noqa: E402
from coding_harnesses import HARNESSES  # noqa: E402

from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir  # noqa: E402
from trainer_client import launch_gateway  # noqa: E402

TASK = "List the files in this directory, then tell me what you found."
_TAGGED = re.compile(r"<([a-z_-]+)>.*?</\1>", re.DOTALL)


class Recorder(ThreadingHTTPServer):
    """Forwards every request to the gateway and keeps (path, body, reply) of each."""

    def __init__(self, target: int) -> None:
        self.target, self.seen = target, []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        conn = http.client.HTTPConnection("127.0.0.1", self.server.target, timeout=600)
        conn.request("POST", self.path, body=body,
                     headers={k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")})
        reply = conn.getresponse()
        data = reply.read()
        with self.server.lock:
            self.server.seen.append((self.path, body, data))
        self.send_response(reply.status)
        for name, value in reply.getheaders():
            if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST

    def log_message(self, *args: Any) -> None:
        pass


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(part.get("text") or part.get("content") or "") for part in content
                         if isinstance(part, dict))
    return ""


def _usage(reply: bytes) -> int | None:
    found = re.findall(rb'"(?:prompt_tokens|input_tokens)":(\d+)', reply)
    return int(found[-1]) if found else None


def measure(path: str, body: dict[str, Any], reply: bytes) -> dict[str, Any]:
    """One request's prompt, by part."""
    system = _text(body.get("system")) + _text(body.get("instructions"))
    users = []
    for message in body.get("messages") or body.get("input") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer"):
            system += _text(message.get("content"))
        elif role == "user":
            users.append(_text(message.get("content")))
    tagged = sum(len(m.group(0)) for text in users for m in _TAGGED.finditer(text))
    tools = body.get("tools") or []
    return {"route": path.split("?")[0], "stream": bool(body.get("stream")), "system_chars": len(system),
            "tools": len(tools), "tool_chars": len(json.dumps(tools)), "tagged_chars": tagged,
            "prompt_tokens": _usage(reply)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", action="append", choices=sorted(HARNESSES), help="default: all")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra setting for the harness (e.g. CLAUDE_CODE_ATTRIBUTION_HEADER=0)")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)
    tokenizer_dir = prepare_tokenizer_dir(None, chat_template_path=str(trl_qwen3_template_path()))
    with FakeEngine(tokenizer_dir) as engine, launch_gateway(
        workers=2, engine_kind="vllm", engine_urls=[engine.url], tokenizer=tokenizer_dir
    ) as gw:
        recorder = Recorder(int(gw.base_url.rsplit(":", 1)[1].split("/")[0]))
        threading.Thread(target=recorder.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{recorder.server_address[1]}/v1"
        print("| harness | request | route | stream | system chars | tools | tool chars | tagged chars in user "
              "turns | prompt tokens |\n|---|---|---|---|---|---|---|---|---|")
        for name in args.harness or list(HARNESSES):
            harness = HARNESSES[name]
            sid, aux = gw.client.open_session(), gw.client.open_session()
            engine.configure(policy={"key": None, "prefer_tools": [harness.tool],
                                     "arguments": {harness.tool: harness.arguments("MARKER", Path("/tmp"))}})
            recorder.seen.clear()
            with tempfile.TemporaryDirectory() as root:
                done = harness.run(base, sid, aux, TASK, Path(root), extra_env=extra_env)
            if done.returncode != 0:
                print(f"{name} exited {done.returncode}:\n{done.stdout[-2000:]}", file=sys.stderr)
            for i, (path, body, reply) in enumerate(recorder.seen, 1):
                row = measure(path, json.loads(body), reply)
                print(f"| {name} | {i} | `{row['route']}` | {row['stream']} | {row['system_chars']} | {row['tools']} "
                      f"| {row['tool_chars']} | {row['tagged_chars']} | {row['prompt_tokens']} |")
            gw.client.drop_session(sid)
            gw.client.drop_session(aux)
        recorder.shutdown()


if __name__ == "__main__":
    main()
