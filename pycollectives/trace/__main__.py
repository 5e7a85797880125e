"""python -m pycollectives.trace merge -o OUT.json IN.json ..."""

import sys

from pycollectives.trace import main

sys.exit(main())
