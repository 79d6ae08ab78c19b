"""What a worker says of its CURVE handshakes: a refused one is logged as an error, again every
REFUSAL_LOG_INTERVAL_S while it lasts (each reconnection is refused again), and its end once. Reads
`broker.curve.HandshakeWatch`; nothing here blocks the event loop.
"""

from __future__ import annotations

import logging
import time

from broker import curve

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 60.0


class HandshakeLog:
    """Reads `watch`'s events (call `read` when its monitor socket is readable) and logs refusals."""

    def __init__(self, watch: curve.HandshakeWatch, endpoint: str) -> None:
        self.watch = watch
        self._endpoint = endpoint
        self._logged: tuple[str, float] | None = None  # the refusal logged last, and when

    def read(self) -> None:
        refusal = self.watch.read()
        now = time.monotonic()
        if refusal is None:
            if self._logged is not None:
                logger.info("the broker at %s accepts this worker's CURVE key again", self._endpoint)
                self._logged = None
            return
        if self._logged is None or self._logged[0] != refusal or now - self._logged[1] >= REFUSAL_LOG_INTERVAL_S:
            logger.error("%s; no turn can be recorded until it is accepted", refusal)
            self._logged = (refusal, now)
