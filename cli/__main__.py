"""``python -m selfspec_cli``: the ``selfspec`` command."""

import sys

from .main import main

sys.exit(main())
