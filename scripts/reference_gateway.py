"""Benchmark harness only: run the reference gateway (agentcore-rl-toolkit 0.2.0) for side-by-side runs.

Not part of rollout-gateway and none of the reference's code is copied here: this is launcher
glue around its public API, installed at run time into its own venv outside the repository
(`ensure_venv`, default /tmp/ref-venv: `agentcore-rl-toolkit[gateway]==0.2.0` and
`transformers==5.12.1`, which it needs below 5.13). `serve` runs inside that venv: it builds
`RolloutGateway(backend=VllmHttpBackend(engine), renderer=HfTemplateRenderer(tok), ...)` in
"tree" or "linear" history mode, serves it with `ThreadedGatewayServer`, and adds two benchmark
routes for the load generator: `POST /_bench/open` and `POST /_bench/finish` (rows as JSON).
Prints `REFERENCE READY base_url=URL control=URL`. Imports only the stdlib at module level.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REFERENCE_REQUIREMENTS = ("agentcore-rl-toolkit[gateway]==0.2.0", "transformers==5.12.1")
DEFAULT_VENV = Path("/tmp/ref-venv")
READY_LINE = "REFERENCE READY"
INSTALL_TIMEOUT_S = 900.0
FINISH_WAIT_S = 10.0
_MARKER = ".rollout-gateway-bench-ok"


def find_python311() -> str:
    """A Python >= 3.11 interpreter (the reference needs it)."""
    if sys.version_info >= (3, 11):
        return sys.executable
    for name in ("python3.13", "python3.12", "python3.11"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("the reference gateway needs Python >= 3.11; none found on PATH")


def ensure_venv(venv: Path = DEFAULT_VENV, quiet: bool = True) -> Path:
    """Create `venv` with the reference installed, once; returns its python."""
    python = venv / "bin" / "python"
    marker = venv / _MARKER
    wanted = "\n".join(REFERENCE_REQUIREMENTS)
    if marker.exists() and marker.read_text() == wanted and python.exists():
        return python
    print(f"installing the reference gateway into {venv} (once) ...", file=sys.stderr, flush=True)
    subprocess.run([find_python311(), "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S)
    pip = [str(python), "-m", "pip", "install", *(["-q"] if quiet else []), *REFERENCE_REQUIREMENTS]
    subprocess.run(pip, check=True, timeout=INSTALL_TIMEOUT_S)
    marker.write_text(wanted)
    return python


def serve(args: argparse.Namespace) -> None:
    """Inside the reference venv: build, serve, and block until SIGTERM/SIGINT."""
    from agentcore_rl_toolkit.rollout_gateway import HfTemplateRenderer, RolloutGateway, ThreadedGatewayServer
    from agentcore_rl_toolkit.rollout_gateway.sampling_backends.vllm_http import VllmHttpBackend
    from aiohttp import web
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    gateway = RolloutGateway(
        backend=VllmHttpBackend(args.engine_url),
        renderer=HfTemplateRenderer(tokenizer),
        tokenizer=tokenizer,
        adapters=args.adapters.split(","),
        history_mode=args.history_mode,
    )
    counter = iter(range(1 << 62))

    async def open_sessions(request: web.Request) -> web.Response:
        body = await request.json()
        sids = []
        for _ in range(int(body.get("count", 1))):
            sid = f"ref-{os.getpid()}-{next(counter)}"
            gateway.create_session(sid, sampling_defaults=body.get("sampling_defaults") or {"temperature": 1.0})
            sids.append(sid)
        return web.json_response({"sids": sids})

    async def finish(request: web.Request) -> web.Response:
        body = await request.json()
        records = await gateway.finish_session(
            body["sid"], reward=float(body.get("reward", 0.0)), wait_timeout=FINISH_WAIT_S
        )
        rows = [_row(r) for r in records]
        return web.json_response({"rows": rows})

    gateway.app.router.add_post("/_bench/open", open_sessions)
    gateway.app.router.add_post("/_bench/finish", finish)
    server = ThreadedGatewayServer(gateway, host=args.host, port=args.port)
    server.start()
    control = server.base_url.removesuffix("/v1") + "/_bench"
    print(f"{READY_LINE} base_url={server.base_url} control={control} pid={os.getpid()}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()


def _row(record: Any) -> dict[str, Any]:
    return {
        "token_ids": list(record.token_ids),
        "loss_mask": list(record.loss_mask),
        "logprobs": list(record.logprobs),
        "response_length": int(record.response_length),
        "metadata": {k: v for k, v in (record.metadata or {}).items() if isinstance(v, (str, int, float, bool))},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="create the reference venv (idempotent) and print its python")
    setup.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    run = sub.add_parser("serve", help="run the reference gateway (inside its venv)")
    run.add_argument("--tokenizer", required=True, help="tokenizer directory (the same one our gateway uses)")
    run.add_argument("--engine-url", required=True)
    run.add_argument("--history-mode", choices=["tree", "linear"], default="tree")
    run.add_argument("--adapters", default="openai", help="comma-separated: openai,anthropic")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.command == "setup":
        print(ensure_venv(args.venv, quiet=False))
    else:
        serve(args)


if __name__ == "__main__":
    main()
