"""`ThreadInbox`: how the event loop tells a compute thread that work arrived."""

from __future__ import annotations

import asyncio
import threading

from specpipe.services.thread_handoff import ThreadInbox


class _Counted(ThreadInbox):
    def __init__(self) -> None:
        super().__init__()
        self.told = 0

    def notify(self, n: int = 1) -> None:
        self.told += 1
        super().notify(n)


def test_a_wake_on_the_loop_tells_the_thread_once_its_callback_is_done() -> None:
    async def main() -> tuple[int, int]:
        inbox = _Counted()
        inbox.wake()
        inbox.wake()  # the same callback: one notify
        during = inbox.told
        await asyncio.sleep(0)
        return during, inbox.told

    assert asyncio.run(main()) == (0, 1)


def test_wakes_while_gathering_tell_the_thread_once_at_its_end_without_a_loop_turn() -> None:
    """A read's frames (`Transport.gather`): the thread is told when the last of them is
    in the inbox, before the loop turns again; nested gathering tells it at the outer end."""

    async def main() -> list[int]:
        inbox = _Counted()
        seen = []
        with inbox.gathering:
            inbox.wake()
            with inbox.gathering:
                inbox.wake()
            seen.append(inbox.told)  # not yet: the outer read goes on
        seen.append(inbox.told)
        with inbox.gathering:
            pass  # no work came: nobody told
        seen.append(inbox.told)
        await asyncio.sleep(0)
        seen.append(inbox.told)  # nothing scheduled besides
        return seen

    assert asyncio.run(main()) == [0, 1, 1, 1]


def test_a_wake_from_another_thread_tells_it_at_once_even_while_the_loop_gathers() -> None:
    async def main() -> int:
        inbox = _Counted()
        with inbox.gathering:
            t = threading.Thread(target=inbox.wake)
            t.start()
            t.join()
            return inbox.told

    assert asyncio.run(main()) == 1
