"""`InPlaceFuture` (services/router/in_place.py): its `then` callbacks run where it is
settled, before `set_result` returns; it stays an asyncio future for everyone else; a
callback that raises is reported and stops neither the others nor the settler."""

from __future__ import annotations

import asyncio

from specpipe.services.router.in_place import InPlaceFuture, when_done


def test_then_runs_where_the_future_is_settled() -> None:
    async def main() -> None:
        seen: list[object] = []
        f = InPlaceFuture()
        f.then(lambda c: seen.append(("then", c.result())))
        f.add_done_callback(lambda c: seen.append("done callback"))
        f.set_result(3)
        seen.append("settled")
        assert seen == [("then", 3), "settled"]  # the done callback waits for a turn
        assert await f == 3
        await asyncio.sleep(0)
        assert seen[-1] == "done callback"
        f.then(lambda c: seen.append("late"))  # done already: at once
        assert seen[-1] == "late"

        g = InPlaceFuture()
        when_done(g, lambda c: seen.append(("cancelled", c.cancelled())))
        assert g.cancel() and seen[-1] == ("cancelled", True)
        assert not g.cancel()  # once only

        plain = asyncio.get_running_loop().create_future()
        when_done(plain, lambda c: seen.append("plain"))
        plain.set_result(None)
        assert seen[-1] != "plain"  # a plain future's callback: in a later turn
        await asyncio.sleep(0)
        assert seen[-1] == "plain"

    asyncio.run(main())


def test_a_failing_callback_is_reported_and_the_others_still_run() -> None:
    async def main() -> None:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        seen: list[str] = []
        f = InPlaceFuture()
        f.then(lambda c: 1 / 0)
        f.then(lambda c: seen.append("second"))
        f.set_exception(ValueError("refused"))
        assert seen == ["second"]
        assert isinstance(errors[0]["exception"], ZeroDivisionError)
        assert isinstance(f.exception(), ValueError)

    asyncio.run(main())
