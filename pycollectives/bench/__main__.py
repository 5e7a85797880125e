"""python -m pycollectives.bench (see pycollectives/bench/cli.py)."""

import sys

from pycollectives.bench.main import main

sys.exit(main())
