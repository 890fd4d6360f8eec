"""`python -m specpipe.cli`: how `specpipe up` starts its child processes."""

import sys

from specpipe.cli import main

sys.exit(main())
