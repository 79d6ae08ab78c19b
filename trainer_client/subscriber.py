"""`EpisodeStream`: a blocking iterator over finished episodes, with credit, leases and acknowledgements.

The subscriber side of the broker's episode outbox (broker/episodes/outbox.py): one socket of its own
from its client's `ControlChannel`, one `FetchEpisodes` request per step that acknowledges what was consumed, renews the
lease, reports what it holds and asks for as many episodes as its credit allows (a long poll
when nothing is buffered). Delivery is at least once: an episode stays leased to this stream
until acknowledged, and goes to another subscriber (marked redelivered) if this one stops
polling for longer than its lease. A broker started with `--state-dir` keeps its outbox across
restarts (same epoch and delivery ids: acks and held episodes carry on); an in-memory broker's
restart loses the episodes it held unacknowledged (a new epoch: the stream reconnects by itself
and logs how many it held). A step whose connection ends (the broker crashed) is sent again as it
was once the broker answers: a repeat acknowledges nothing twice, and the episodes the lost reply
leased come again (marked redelivered), so iteration goes on through the restart. Plain blocking
pyzmq in the caller's thread; imports zmq, the stdlib, `broker.protocol` and `trainer_client` only.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from types import TracebackType

from broker import protocol
from trainer_client.control_socket import ControlChannel, ControlSocket
from trainer_client.errors import EpisodeTimeout, GatewayError, InvalidRequest
from trainer_client.records import Episode

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 4
# A stream that does not poll for this long is presumed dead: its unacknowledged episodes go
# to other subscribers. Set it above the longest time you spend on one episode between two steps.
DEFAULT_LEASE_S = 60.0
# One long poll waits at most this long at the broker; shorter keeps explicit acks from other
# threads (which wait for the poll to return) prompt, longer saves idle round trips.
POLL_WAIT_S = 2.0
# close() hands back what it holds with this deadline; past it the lease runs out instead.
CLOSE_TIMEOUT_S = 2.0
MAX_PENDING_LIMIT = 1_024


class EpisodeStream:
    """Finished episodes, one `next()` at a time: `for episode in client.episodes(): ...`.

    Moving to the next episode acknowledges the previous one (with `auto_ack`); `episode.ack()`
    does it at once. Use it as a context manager (or call `close()`) so that, on the way out, the
    last episode is acknowledged and unseen buffered ones go straight back to the broker; an
    exception leaving the `with` block hands the current one back unacknowledged (it will be
    redelivered). A stream abandoned without `close()` gets its episodes redelivered once its
    lease runs out. One thread iterates a stream (in the process that created it); `ack()` may
    come from any thread, and waits for a long poll in progress (at most POLL_WAIT_S) to return.

    Args:
        channel: its client's `ControlChannel` (the broker's control endpoint).
        owner_id: its client's id, which this stream's subscriber id starts with.
        call_timeout: seconds the broker has to answer one step beyond its long poll (its client's timeout).
        timeout: seconds one `next()` waits for an episode before raising `EpisodeTimeout`;
            None waits for ever. A broker that does not answer raises `BrokerTimeout` after the
            client's timeout; the stream stays usable (it reconnects on the next call).
        max_pending: episodes leased to this stream at once: yielded-unacknowledged plus prefetched.
        client_id: only episodes of sessions opened by the client with this id (only_mine), or None.
        group: only episodes of sessions opened with this group, or None.
        lease: seconds this stream promises to call the broker again within (see DEFAULT_LEASE_S).
        auto_ack: acknowledge the previous episode on `next()`; False leaves every episode to `ack()`.
    """

    def __init__(
        self,
        channel: ControlChannel,
        owner_id: str,
        call_timeout: float,
        *,
        timeout: float | None,
        max_pending: int,
        client_id: str | None,
        group: str | None,
        lease: float,
        auto_ack: bool,
    ) -> None:
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
        if not (isinstance(max_pending, int) and 1 <= max_pending <= MAX_PENDING_LIMIT):
            raise ValueError(f"max_pending must be an int in 1..{MAX_PENDING_LIMIT}, got {max_pending!r}")
        if not (isinstance(lease, (int, float)) and lease > 0 and math.isfinite(lease)):
            raise ValueError(f"lease must be a positive number of seconds, got {lease!r}")
        self.subscriber_id = f"{owner_id}/{secrets.token_hex(6)}"
        self._channel = channel
        self._call_timeout = call_timeout
        self._timeout = timeout
        self._max_pending = max_pending
        self._client_id = client_id
        self._group = group
        self._lease = float(lease)
        self._auto_ack = auto_ack
        self._lock = threading.Lock()  # the socket and the bookkeeping below
        self._sock: ControlSocket | None = None
        self._epoch = ""  # the broker incarnation our delivery ids belong to
        self._buffer: deque[Episode] = deque()  # delivered, not yet yielded
        self._unacked: dict[int, Episode] = {}  # yielded, not yet acknowledged
        self._acks: list[int] = []  # acknowledged here, not yet confirmed by the broker
        self._release: list[int] = []  # handed back unseen, not yet confirmed
        self._closed = False

    # --- iteration ---------------------------------------------------------------------

    def __iter__(self) -> EpisodeStream:
        return self

    def __next__(self) -> Episode:
        with self._lock:
            if self._closed:
                raise StopIteration
            if self._auto_ack:
                self._acks.extend(self._unacked)
                self._unacked.clear()
            elif len(self._unacked) >= self._max_pending:
                raise InvalidRequest(
                    f"{len(self._unacked)} episodes are yielded and unacknowledged (max_pending={self._max_pending}): "
                    "ack() some before asking for more"
                )
            deadline = None if self._timeout is None else time.monotonic() + self._timeout
            # Every step talks to the broker once (acks, lease, refill); it waits only when nothing is buffered.
            self._exchange(0.0 if self._buffer else self._wait(deadline), fetch=True)
            while not self._buffer:
                if deadline is not None and time.monotonic() >= deadline:
                    raise EpisodeTimeout(
                        f"no episode within {self._timeout:.1f}s (filters: group={self._group!r}, "
                        f"only_mine={self._client_id is not None})"
                    )
                self._exchange(self._wait(deadline), fetch=True)
            episode = self._buffer.popleft()
            self._unacked[episode.delivery_id] = episode
            return episode

    def ack(self, episode: Episode) -> None:
        """Acknowledge `episode` now (usually via `episode.ack()`); a no-op if it is no longer held here."""
        with self._lock:
            if self._unacked.get(episode.delivery_id) is not episode:
                return  # acknowledged already, revoked, or from a broker that has since restarted
            del self._unacked[episode.delivery_id]
            self._acks.append(episode.delivery_id)
            if not self._closed:
                self._exchange(0.0, fetch=False)

    @property
    def pending(self) -> int:
        """Episodes held here unacknowledged: yielded plus prefetched."""
        with self._lock:
            return len(self._buffer) + len(self._unacked)

    # --- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        """Acknowledge the last yielded episode (with auto_ack), hand back unseen ones, close the socket."""
        self._close(ack_current=True)

    def __enter__(self) -> EpisodeStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(ack_current=exc_type is None)

    def _close(self, ack_current: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            holding = bool(self._buffer or self._unacked or self._acks)
            if ack_current and self._auto_ack:
                self._acks.extend(self._unacked)
            # Unacknowledged yielded ones are neither held nor released: the broker requeues them marked.
            self._unacked.clear()
            self._release.extend(e.delivery_id for e in self._buffer)
            self._buffer.clear()
            try:
                if holding:  # (a socket dropped after a timeout is simply made again)
                    self._exchange(0.0, fetch=False, timeout=CLOSE_TIMEOUT_S)
            except GatewayError as e:
                logger.warning(
                    "episode stream %s closed without reaching the broker (%s); its lease will run out",
                    self.subscriber_id,
                    e,
                )
            finally:
                self._drop_socket()

    # --- one exchange ------------------------------------------------------------------

    def _wait(self, deadline: float | None) -> float:
        if deadline is None:
            return POLL_WAIT_S
        return max(0.0, min(POLL_WAIT_S, deadline - time.monotonic()))

    def _exchange(self, wait: float, *, fetch: bool, timeout: float | None = None) -> None:
        """One FetchEpisodes round trip; on success the acks and releases it carried are settled."""
        channel = self._channel
        held = [e.delivery_id for e in self._buffer] + list(self._unacked)
        credit = max(0, self._max_pending - len(held)) if fetch else 0
        acks, release = list(self._acks), list(self._release)
        msg = protocol.FetchEpisodes(
            channel.next_id(),
            self.subscriber_id,
            self._epoch,
            credit,
            acks,
            held,
            release,
            wait,
            self._lease,
            self._client_id,
            self._group,
        )
        frame = channel.encode(msg)
        if self._sock is None:
            self._sock = channel.new_socket()
        try:
            # A repeat is harmless: acks of episodes acknowledged already change nothing, and what the lost reply
            # leased is neither held nor acknowledged, so the broker hands it out again (redelivered).
            reply, _ = self._sock.roundtrip(
                frame, msg, wait + (self._call_timeout if timeout is None else timeout), resend=True
            )
        except BaseException:
            self._drop_socket()  # a late reply must not reach a later request
            raise
        delivered = channel.expect(msg, reply, protocol.EpisodesDelivered)
        self._apply(delivered, len(acks), len(release))

    def _apply(self, reply: protocol.EpisodesDelivered, n_acks: int, n_release: int) -> None:
        if reply.epoch != self._epoch:
            if self._epoch and (self._buffer or self._unacked or self._acks):
                # Documented: an in-memory broker's outbox (a new epoch); what it held is gone with it.
                logger.warning(
                    "the broker restarted: %d unacknowledged episode(s) held by stream %s were lost with it",
                    len(self._buffer) + len(self._unacked) + len(self._acks),
                    self.subscriber_id,
                )
            self._epoch = reply.epoch
            self._buffer.clear()
            self._unacked.clear()
            self._acks.clear()
            self._release.clear()
        else:
            del self._acks[:n_acks], self._release[:n_release]
            if reply.revoked:
                # Our lease ran out and they went elsewhere: processing them would only duplicate work.
                revoked = set(reply.revoked)
                logger.warning("stream %s lost %d episode(s) to lease expiry", self.subscriber_id, len(revoked))
                self._buffer = deque(e for e in self._buffer if e.delivery_id not in revoked)
                for d in revoked:
                    self._unacked.pop(d, None)
        self._buffer.extend(Episode.from_wire(e, self.ack) for e in reply.episodes)

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._channel.discard(self._sock)
            self._sock = None
