"""`python -m octavo serve|generate|bench ...`: the `octavo` command."""

import sys

from octavo.server.cli import main

# The guard matters: the engine core's process (spawned) imports this module again.
if __name__ == "__main__":
    sys.exit(main())
