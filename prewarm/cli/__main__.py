"""`python -m prewarm.cli`: the same command as the `prewarm` console script."""

import sys

from prewarm.cli import main

sys.exit(main())
