"""``python -m kvoffload.bench``: the same as ``kvoffload bench``."""

import sys

from .command import main

sys.exit(main())
