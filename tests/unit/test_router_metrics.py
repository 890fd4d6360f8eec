"""The router's request gauges, read from the router when scraped."""

from types import SimpleNamespace

from prometheus_client import generate_latest
from specpipe.services.metrics import RouterMetrics


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_num_requests_waiting_counts_queued_and_opening_requests() -> None:
    """The chart autoscales on num_requests_waiting: a request queued for a running slot
    waits as much as one opening its path."""
    drivers = {
        "r1": SimpleNamespace(waiting=False),  # producing tokens
        "r2": SimpleNamespace(waiting=True),  # opening its path
    }
    router = SimpleNamespace(
        transport=None,
        drivers=drivers,
        backends=SimpleNamespace(by_key={}, model=None, versions={}),
        model=None,
        scheduler=SimpleNamespace(waiting=["q1", "q2", "q3"]),  # queued for a slot
    )
    metrics = RouterMetrics()
    metrics.watch(router)
    text = generate_latest(metrics.registry).decode()
    assert _gauge(text, "specpipe:num_requests_running") == 1
    assert _gauge(text, "specpipe:num_requests_waiting") == 4
    assert _gauge(text, "vllm:num_requests_waiting") == 4
    drivers["r2"].waiting = False
    router.scheduler.waiting = []
    text = generate_latest(metrics.registry).decode()
    assert _gauge(text, "specpipe:num_requests_waiting") == 0
    assert _gauge(text, "specpipe:num_requests_running") == 2
