"""python -m pycollectives.trace merge -o OUT.json IN.json ... | analyze DIR"""

import sys

from pycollectives.trace import main

sys.exit(main())
