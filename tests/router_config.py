"""Routers built in a test's own process, as `specpipe router` builds them: a
`RouterConfig` first, then the engine and its front ends from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specpipe.services.config import RouterConfig, SchedulingConfig
from specpipe.services.router.engine import RouterEngine
from specpipe.services.router.requests import RequestDefaults
from specpipe.services.router.service import RouterService

# What a request leaves unset, as the engine's own defaults (nothing tuned): tests
# compare tokens, which a tuned width or layer count would not change, but its
# calibration would add time and requests of its own.
FIXED = dataclasses.asdict(RequestDefaults.fixed())


def router_config(
    stages: Sequence[str], draft: str | None = None, scheduling=None, **settings
) -> RouterConfig:
    """A router over the `stages` and `draft` addresses, plaintext (a test passes its
    `Security` to the engine), with the fixed request defaults unless `scheduling` (a
    mapping of SchedulingConfig fields) says otherwise; `settings`: RouterConfig's."""
    return RouterConfig(
        stages=tuple(stages),
        drafts=(draft,) if draft else (),
        secure=False,
        scheduling=SchedulingConfig.of({**FIXED, **(scheduling or {})}),
        **settings,
    )


def router_engine(stages: Sequence[str], draft: str | None = None, **kw) -> RouterEngine:
    """The engine of `router_config(stages, draft, **kw)`; its live objects
    (`discovery`, `api_keys`, `security`, `metrics`) pass through."""
    live = {k: kw.pop(k) for k in ("discovery", "api_keys", "security", "metrics") if k in kw}
    return RouterEngine(router_config(stages, draft, **kw), **live)


def router_service(
    stages: Sequence[str], draft: str | None = None, *, public_tls=None, limits=None, **kw
) -> RouterService:
    """The gRPC front end over `router_engine(stages, draft, **kw)`."""
    return RouterService(router_engine(stages, draft, **kw), public_tls, limits)
