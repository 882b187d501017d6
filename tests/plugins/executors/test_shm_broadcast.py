"""The ``mp`` executor's step ring in shared memory: order, back-pressure, overflow, failures, clean-up."""
import os
import pickle
import threading
import time

import pytest

from kvforge.plugins.executors.shm_broadcast import OVERFLOW, RingAddress, ShmBroadcast


def ok() -> None:
    pass


def _reader(address: RingAddress, count: int, out: list, side: dict[int, bytes], delay_s: float = 0.0) -> None:
    ring = address.attach()
    try:
        for _ in range(count):
            data = ring.read(ok)
            out.append(side[ring.count] if data is OVERFLOW else data)
            time.sleep(delay_s)
    finally:
        ring.close()


def test_every_reader_gets_every_message_in_order_through_many_laps_with_overflow():
    ring = ShmBroadcast.create(readers=2, chunks=4, chunk_bytes=256)
    messages = [pickle.dumps(("step", i, b"x" * (i * 37 % 600))) for i in range(60)]  # some over 256 bytes
    side: dict[int, bytes] = {}  # what goes "over the socket": by message number
    outs: list[list[bytes]] = [[], []]
    threads = [threading.Thread(target=_reader, args=(RingAddress(ring.name, 2, r, 4, 256, 0.0), 60, outs[r], side,
                                                      0.001 * r)) for r in range(2)]
    for t in threads:
        t.start()
    overflowed = 0
    for i, m in enumerate(messages):
        side[i + 1] = m  # before the marker, as the executor's connection delivers it after
        overflowed += not ring.write(m, ok)
    for t in threads:
        t.join(10)
    ring.close()
    assert overflowed == sum(len(m) > 256 for m in messages) > 0
    assert outs[0] == messages and outs[1] == messages


def test_the_writer_waits_for_the_slowest_reader_and_names_a_dead_one():
    ring = ShmBroadcast.create(readers=1, chunks=2, chunk_bytes=64)
    assert ring.write(b"a", ok) and ring.write(b"b", ok)  # the ring is full: nobody read

    class ReaderGone(RuntimeError):
        pass
    calls = []

    def dead() -> None:
        calls.append(1)
        if len(calls) >= 3:
            raise ReaderGone("rank 1 died")
    start = time.monotonic()
    with pytest.raises(ReaderGone):
        ring.write(b"c", dead)
    assert 0.1 < time.monotonic() - start < 2  # it waited, looking now and then, and gave up when told
    reader = RingAddress(ring.name, 1, 0, 2, 64, 0.0).attach()
    assert reader.read(ok) == b"a"  # a chunk is free again: the write goes through at once
    assert ring.write(b"c", ok) and [reader.read(ok), reader.read(ok)] == [b"b", b"c"]
    reader.close()
    ring.close()


def test_a_waiting_reader_learns_the_writer_is_gone():
    ring = ShmBroadcast.create(readers=1, chunks=2, chunk_bytes=64)
    reader = RingAddress(ring.name, 1, 0, 2, 64, 0.0).attach()
    gone = threading.Event()
    threading.Timer(0.3, gone.set).start()

    def writer_alive() -> None:
        if gone.is_set():
            raise EOFError("the engine closed its connection")
    with pytest.raises(EOFError):
        reader.read(writer_alive)
    reader.close()
    ring.close()


def test_the_segment_is_gone_once_the_writer_closes_and_readers_do_not_remove_it():
    ring = ShmBroadcast.create(readers=1)
    path = f"/dev/shm/{ring.name.lstrip('/')}"
    reader = RingAddress(ring.name, 1, 0).attach()
    reader.close()
    assert os.path.exists(path)  # a reader's exit leaves the writer's segment alone
    ring.close()
    assert not os.path.exists(path)
