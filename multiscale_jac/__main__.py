"""``python -m multiscale_jac demo``."""

import sys

from .cli import main

sys.exit(main())
