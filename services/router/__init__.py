"""The router: the client-facing Generation service and the network executor of every
request's controller."""

from .calls import DriverError
from .driver import RequestDriver
from .requests import Plan
from .service import RouterService

__all__ = ["DriverError", "Plan", "RequestDriver", "RouterService"]
