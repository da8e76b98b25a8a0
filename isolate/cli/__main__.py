"""``python -m isolate.cli``: the Python ``isolate-run``."""

import sys

from .main import main

sys.exit(main())
