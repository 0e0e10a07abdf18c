"""``python -m shiftguard`` (also what ``torchrun -m shiftguard run`` executes)."""

import sys

from shiftguard.cli import main

sys.exit(main())
