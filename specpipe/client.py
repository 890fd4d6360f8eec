"""`specpipe.client`: the client SDK (implemented in `specpipe.services.client`)."""

from specpipe.services.client import *  # noqa: F403
from specpipe.services.client import __all__  # noqa: F401
