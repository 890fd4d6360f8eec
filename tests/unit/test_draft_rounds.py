"""The draft's compute thread (services/draft_rounds.py): the work that waits is taken
off the event loop, one item per request per batch, items whose caller went away are
dropped, and a thread that dies ends the loop instead of leaving its callers hanging."""

from __future__ import annotations

import asyncio
import threading
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
