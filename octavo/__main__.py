"""`python -m octavo serve|generate|bench ...`: the `octavo` command."""

import sys

from octavo.server.cli import main

sys.exit(main())
