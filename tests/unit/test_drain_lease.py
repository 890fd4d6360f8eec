"""A draining service's leases (services/lease.py): `LeaseTable.shorten` bounds every
lease to the drain lease past its last renewal, renewals then extend it only that long,
and the reaper follows the shorter time."""

from __future__ import annotations

import asyncio

import pytest
from specpipe.common.runtime.lease import LeaseTable
from specpipe.services.lease import reap_expired


def test_shorten_bounds_every_lease_and_later_renewals() -> None:
    now = [100.0]
    leases = LeaseTable(60.0, clock=lambda: now[0])
    leases.grant("a")
    now[0] = 159.0
    leases.grant("b")  # expires at 219
    leases.shorten(3.0)
    assert leases.seconds == 3.0
    now[0] = 160.5
    assert leases.expired() == ["a"]  # its 60 s ran out first (at 160)
    now[0] = 161.5
    assert not leases.renew("nope") and leases.renew("b")  # now to 164.5, not 221.5
    now[0] = 164.4
    assert leases.expired() == ["a"]
    now[0] = 164.6
    assert sorted(leases.expired()) == ["a", "b"]
    leases.shorten(30.0)  # never longer again
    assert leases.seconds == 3.0
    with pytest.raises(ValueError):
        leases.shorten(0)


def test_a_shortened_lease_is_reaped() -> None:
    async def main() -> list[str]:
        leases = LeaseTable(600.0)
        leases.grant("r")
        freed: list[str] = []
        reaper = asyncio.create_task(reap_expired(leases, freed.append))
        await asyncio.sleep(0)
        leases.shorten(0.2)
        try:
            await asyncio.wait_for(_until(lambda: freed), 30)
        finally:
            reaper.cancel()
        return freed

    assert asyncio.run(main()) == ["r"]


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.01)
