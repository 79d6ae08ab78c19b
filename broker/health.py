"""Health checks of the engine replicas, on a thread of their own (the broker's loop never waits on HTTP).

Every `interval_s` the thread asks each replica of `watch`'s latest list for `GET {url}/health` (vLLM and
SGLang both answer 200 while they serve), one after the other, each bounded by `timeout_s`; an answer
other than 200 or not HTTP at all, a refused connection or a timeout is a failed check. Verdicts go into
`results`, a queue the broker's loop drains each pass (`sessions.replicas.ReplicaTable.health`).
Certificates of https:// replicas are checked against the system's CAs. Imports only the stdlib.
"""

from __future__ import annotations

import http.client
import logging
import queue
import threading
import urllib.error
import urllib.request

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0


class HealthChecker:
    """Checks the replicas of the latest `watch` every `interval_s`; verdicts (url, healthy, error) in `results`."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"health check interval and timeout must be positive, got {interval_s}, {timeout_s}")
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.results: queue.SimpleQueue[tuple[str, bool, str]] = queue.SimpleQueue()
        self._urls: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)

    def watch(self, urls: tuple[str, ...]) -> None:
        """Check these from the next round on (called from the loop's thread; a tuple is swapped whole)."""
        self._urls = urls

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url in self._urls:
                if self._stop.is_set():
                    return
                try:
                    verdict = self.check(url)
                except Exception:  # a bug of ours: that verdict is lost, never the checks that follow
                    logger.exception("the health check of %s failed", url)
                    continue
                self.results.put((url, *verdict))

    def check(self, url: str) -> tuple[bool, str]:
        """(healthy, why not) for one replica."""
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=self.timeout_s) as reply:
                return (True, "") if reply.status == 200 else (False, f"/health answered {reply.status}")
        except urllib.error.HTTPError as e:
            return False, f"/health answered {e.code}"
        except (OSError, ValueError, http.client.HTTPException) as e:
            # refused, reset, timed out, unresolvable, a malformed url, an answer that is not HTTP
            return False, f"/health failed: {type(e).__name__}: {e}"[:300]
