"""Which requests name themselves for retries, and which attempts are retries (`turns.replay.retry_key`)."""

from __future__ import annotations

import zlib

from gateway_workers.turns import replay

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def retry_key(path: str, idempotency_key: str | None, retry_count: str | None, body: bytes) -> replay.RetryKey | None:
    return replay.retry_key(path, idempotency_key, retry_count, len(body), zlib.crc32(body))


def test_a_request_without_either_header_has_no_key():
    assert retry_key("/v1/chat/completions", None, None, BODY) is None


def test_a_first_attempt_is_named_but_is_no_retry_and_a_later_one_is():
    first = retry_key("/v1/chat/completions", None, "0", BODY)
    again = retry_key("/v1/chat/completions", None, "2", BODY)
    assert first is not None and again is not None
    assert not first.retry and again.retry and first.digest == again.digest


def test_an_idempotency_key_always_asks_for_its_earlier_turn():
    key = retry_key("/v1/messages", "job-7", None, BODY)
    assert key is not None and key.retry
    assert key.digest != retry_key("/v1/messages", "job-8", None, BODY).digest  # type: ignore[union-attr]


def test_the_digest_covers_route_key_and_body_without_ambiguity():
    digests = {
        retry_key(path, idem, "1", body).digest  # type: ignore[union-attr]
        for path, idem, body in [
            ("/v1/chat/completions", None, BODY),
            ("/v1/responses", None, BODY),
            ("/v1/chat/completions", None, BODY + b" "),
            ("/v1/chat/completions", "ab", b"c"),
            ("/v1/chat/completions", "a", b"bc"),  # the same bytes, split elsewhere
        ]
    }
    assert len(digests) == 5
