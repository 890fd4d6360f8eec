"""The draft's compute thread (services/draft_rounds.py): the work that waits is taken
off the event loop, one item per request per batch, items whose caller went away are
dropped, and a thread that dies ends the loop instead of leaving its callers hanging."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
from specpipe.common.runtime.alignment import StepAligner
from specpipe.services.draft_rounds import DraftRounds


@dataclass
class Item:
    request_id: str
    n: int
    cancelled: bool = False

    def gone(self) -> bool:
        return self.cancelled


def _on_thread(batch: list[Item]) -> list[tuple[str, int]]:
    return [(threading.current_thread().name, item.n) for item in batch]


def test_a_batch_takes_each_request_first_item_on_the_compute_thread() -> None:
    async def main() -> list[tuple[list[int], list]]:
        delivered: asyncio.Queue = asyncio.Queue()
        rounds: DraftRounds[Item] = DraftRounds(StepAligner(0.0), _on_thread)
        task = asyncio.create_task(rounds.run_forever(lambda b, r: delivered.put_nowait((b, r))))
        await asyncio.sleep(0)  # the thread runs
        for item in (Item("a", 1), Item("b", 2), Item("a", 3), Item("c", 4, cancelled=True)):
            rounds.add(item)  # one callback of the loop: one batch for a and b
        got = []
        for _ in range(2):
            batch, results = await asyncio.wait_for(delivered.get(), 10)
            got.append(([i.n for i in batch], results))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rounds.take_all() == []
        return got

    first, second = asyncio.run(main())
    assert first == ([1, 2], [("draft rounds", 1), ("draft rounds", 2)])
    assert second == ([3], [("draft rounds", 3)])  # a's second call, c's went away


def test_a_compute_thread_that_dies_ends_the_loop_with_its_error() -> None:
    def broken(batch: list[Item]) -> list:
        raise ZeroDivisionError("a bug")

    async def main() -> None:
        rounds: DraftRounds[Item] = DraftRounds(StepAligner(0.0), broken)
        task = asyncio.create_task(rounds.run_forever(lambda b, r: None))
        await asyncio.sleep(0)
        rounds.add(Item("a", 1))
        await asyncio.wait_for(task, 10)

    with pytest.raises(RuntimeError, match="compute thread died") as e:
        asyncio.run(main())
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_the_thread_answers_what_it_can_but_never_ahead_of_a_batch_the_loop_holds() -> None:
    """`answer_now` runs on the compute thread and what it answers never reaches the
    loop; the rest of the batch is delivered there. A batch computed while one handed to
    the loop is still undelivered goes to the loop whole (answered there, after it): the
    thread passes nothing the loop holds."""

    async def main() -> tuple[list, list]:
        answered: list[tuple[str, list[int]]] = []
        delivered: asyncio.Queue = asyncio.Queue()

        def answer_now(batch: list[Item], results: list) -> tuple[list[Item], list]:
            answered.append((threading.current_thread().name, [i.n for i in batch]))
            left = [(i, r) for i, r in zip(batch, results, strict=True) if i.request_id != "a"]
            return [i for i, _ in left], [r for _, r in left]

        second = threading.Event()  # the second batch is computed

        def compute(batch: list[Item]) -> list:
            second.set() if batch[0].n == 3 else None
            return _on_thread(batch)

        rounds: DraftRounds[Item] = DraftRounds(StepAligner(0.0), compute, answer_now)
        task = asyncio.create_task(rounds.run_forever(lambda b, r: delivered.put_nowait(b)))
        await asyncio.sleep(0)
        for item in (Item("a", 1), Item("b", 2), Item("a", 3)):
            rounds.add(item)
        await asyncio.sleep(0)  # the thread is told
        second.wait(10)  # the loop is busy: both batches are computed before it delivers
        time.sleep(0.2)
        got = [[i.n for i in await asyncio.wait_for(delivered.get(), 10)] for _ in range(2)]
        rounds.add(Item("a", 4))  # every batch delivered: the thread answers it
        for _ in range(100):
            if len(answered) == 2:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert delivered.empty()
        return answered, got

    answered, delivered = asyncio.run(main())
    assert answered == [("draft rounds", [1, 2]), ("draft rounds", [4])]
    assert delivered == [[2], [3]]  # b's left by the thread; a's second behind it, whole
