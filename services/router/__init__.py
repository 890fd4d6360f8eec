"""The router / tree manager service: owns every request's tree and drives it."""

from .driver import DriverError, Plan, RequestDriver
from .service import RouterService

__all__ = ["DriverError", "Plan", "RequestDriver", "RouterService"]
