"""`python -m lite_core.cli` is the `lite` command."""

import sys

from lite_core.cli import main

sys.exit(main())
