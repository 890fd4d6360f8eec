"""A future whose owner's callback runs where it is settled (issue 34, point 3).

An asyncio future runs its done callbacks later, each in an event-loop `Handle` of its
own: a draft's answers to many requests, arriving in one control frame, would each cost
a wake-up before the request's lane sees it. `InPlaceFuture.then` runs its callback at
once inside `set_result` / `set_exception` / `cancel`, so one frame's answers are handled
in one pass, in their order in the frame. It is still an asyncio future (awaitable,
`asyncio.wait`, `add_done_callback` as usual) for everyone else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

Then = Callable[["InPlaceFuture"], None]


class InPlaceFuture(asyncio.Future):
    _then: list[Then] | None = None

    def then(self, callback: Then) -> None:
        """Call `callback(self)` where the future is settled (at once if it is done)."""
        if self.done():
            callback(self)
        elif self._then is None:
            self._then = [callback]
        else:
            self._then.append(callback)

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._settled()

    def set_exception(self, exception: BaseException | type[BaseException]) -> None:
        super().set_exception(exception)
        self._settled()

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self._settled()
        return True

    def _settled(self) -> None:
        """Run the `then` callbacks; one that raises is reported as a failed callback
        would be, and neither the others nor whoever settled the future see it."""
        callbacks, self._then = self._then, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception as e:
                self.get_loop().call_exception_handler(
                    {"message": "an in-place callback failed", "exception": e, "future": self}
                )


def when_done(call: asyncio.Future, callback: Then) -> None:
    """`callback(call)` once `call` is done: in place for an `InPlaceFuture`, else as a
    done callback (a unary call's task)."""
    if isinstance(call, InPlaceFuture):
        call.then(callback)
    else:
        call.add_done_callback(callback)  # type: ignore[arg-type]
