"""`python -m service.cli`: the same entry point as the `qkscope` script."""

import sys

from service.cli import main

sys.exit(main())
