"""``python -m shiftguard`` (also what ``torchrun -m shiftguard run`` executes)."""

import sys

from shiftguard.cli import main

# the guard: a process started by multiprocessing's spawn (parallel training) imports this module
# again, as __mp_main__, and must not run the command a second time
if __name__ == "__main__":
    sys.exit(main())
