"""The router's request driver (against router_fakes.py) with a resumed request, and a
replay that goes back to the one replica of a stage once it serves again."""

from __future__ import annotations

import asyncio

import pytest
from specpipe.common.spec.controller import make_controller
from specpipe.common.spec.options import Mode
from specpipe.services.router.driver import DriverSettings, RequestDriver
from specpipe.services.router.path_session import first_path

from .router_fakes import deployment
from .test_router_driver import EXPECTED, PROMPT, assert_released, options


def _run(dep, mode, opts, resume=(), replay_timeout=0.0, prepare=lambda d: None, each=None):
    async def main():
        path = first_path(dep.backends, mode, opts, PROMPT)
        controller = make_controller(mode, "r", PROMPT, opts, len(path.stages))
        controller.resume(resume)
        settings = DriverSettings(replay_timeout=replay_timeout, stall_timeout=30.0)
        driver = RequestDriver(controller, dep.backends, path, "tcp://router:1", dep.inbox,
                               settings=settings, vocab_size=97)  # fmt: skip
        prepare(driver)
        out: list[int] = []
        try:
            async for tokens in driver.run():
                out += tokens
                if each is not None:
                    each(driver, out)
        finally:
            await driver.release()
        return driver, out

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(("mode", "source"), [(Mode.PP, None), (Mode.SPECPIPE, "draft"),
                                              (Mode.SPECINFER, "draft")])  # fmt: skip
def test_a_resumed_request_yields_only_the_rest_of_the_output(mode, source) -> None:
    dep = deployment()
    driver, out = _run(dep, mode, options(source), resume=EXPECTED[:7])
    assert out == EXPECTED[7:]
    assert driver.controller.tokens == EXPECTED
    assert driver.stats.resumed_tokens == 7 and driver.stats.replays == 0
    assert_released(dep, driver)


def test_a_replay_goes_back_to_the_only_replica_once_it_serves_again() -> None:
    """Its one replica of a stage is lost mid-request (a link down): the request waits
    for a path; once the replica is healthy again it takes the request back under a new
    wire id."""
    dep = deployment(ranges=((0, 4),), replicas=1)
    (stage,) = dep.stages

    def prepare(driver: RequestDriver) -> None:
        stage.stub.dies_after = 4  # Open and three feeds, then unreachable

        async def comes_back() -> None:
            while stage.healthy:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            stage.stub.dies_after = None  # the link is back: its health check passes
            stage.healthy = True

        asyncio.get_running_loop().create_task(comes_back())

    driver, out = _run(dep, Mode.PP, options(), replay_timeout=5.0, prepare=prepare)
    assert out == EXPECTED
    assert stage.stub.opened == ["r", "r~1"] and driver.stats.replays == 1
    assert_released(dep, driver)


def test_routers_on_hosts_sharing_a_hostname_get_names_of_their_own() -> None:
    """A router restarted under a name frees its predecessor's requests: two routers
    on hosts with one hostname (network namespaces) must not share a name."""
    from specpipe.services.router.service import default_router_name

    assert default_router_name("10.0.0.2", 50051) != default_router_name("10.0.0.3", 50051)
    assert default_router_name("10.0.0.2", 50051) == "10.0.0.2:50051"
    for local in ("127.0.0.1", "0.0.0.0", "::1", "localhost"):
        assert default_router_name(local, 7).endswith(":7")
        assert not default_router_name(local, 7).startswith(local)
