"""The engine thread hands outputs to the event loop in batches: one wake-up, every item, in order."""

from __future__ import annotations

import asyncio
import threading

from llmkit.serve.serving import _Mailbox


def test_a_burst_of_outputs_wakes_the_loop_once_and_arrives_in_order():
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        box = _Mailbox(loop)
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            nonlocal wakeups
            wakeups += 1
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        a: asyncio.Queue = asyncio.Queue()
        b: asyncio.Queue = asyncio.Queue()

        def engine_step() -> None:  # 64 outputs of one step, while the loop is busy
            for i in range(32):
                box.post(a, i)
                box.post(b, -i)

        t = threading.Thread(target=engine_step)
        t.start()
        t.join()  # the loop is blocked here: nothing delivered yet
        assert a.empty() and b.empty()
        got_a = [await a.get() for _ in range(32)]
        got_b = [await b.get() for _ in range(32)]
        box.post(a, "later")  # after a delivery, the next post schedules another
        assert await a.get() == "later"
        return got_a, got_b, wakeups

    got_a, got_b, wakeups = asyncio.run(main())
    assert got_a == list(range(32)) and got_b == [-i for i in range(32)]
    assert wakeups == 2
