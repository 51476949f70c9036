"""``python -m kvtier`` runs the ``kvtier`` command."""

import sys

from kvtier.cli import main

sys.exit(main())
