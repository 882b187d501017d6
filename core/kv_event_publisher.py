"""``ZmqEventPublisher``: KV event batches on a ZMQ PUB socket (``kv_events_endpoint``), as vLLM sends them.

Each batch is one three-part message: the topic (empty: a subscriber subscribes to ``b""``), the batch's
number in the front end's :class:`~kvforge.kv_events.KVEventLog` as 8 big-endian bytes, and the batch in
msgpack (``kvforge.kv_events.encode``). A subscriber that sees a gap in the numbers missed batches (PUB drops
what a slow subscriber cannot take: the socket never blocks the engine) and can fetch them from
``GET /kv_events?since=N`` while the log still holds them. pyzmq is imported only here.
"""
from __future__ import annotations

import re

from kvforge.kv_events import EventBatch, encode

#: what ``kv_events_endpoint`` may look like (ZMQ's transports a PUB socket can bind)
ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")
#: batches queued for slow subscribers before the socket drops more
SEND_HWM = 100_000


class ZmqEventPublisher:
    def __init__(self, endpoint: str, topic: bytes = b""):
        import zmq

        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_endpoint: cannot bind {endpoint!r}: {exc}") from None

    def publish(self, seq: int, batch: EventBatch) -> None:
        # NOTE: a PUB socket never blocks: past SNDHWM a slow subscriber's messages are dropped
        self._sock.send_multipart((self.topic, seq.to_bytes(8, "big"), encode(batch)))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
