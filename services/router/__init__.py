"""The router: the request engine, its front ends (the gRPC Generation service, the
HTTP API) and the network executor of every request's controller."""

from .calls import DriverError
from .driver import RequestDriver
from .engine import RouterEngine
from .requests import Plan
from .service import RouterService

__all__ = ["DriverError", "Plan", "RequestDriver", "RouterEngine", "RouterService"]
