"""``python -m areal_lightning`` runs the ``areal-lightning`` command line."""

import sys

from areal_lightning.tools.cli import main

sys.exit(main())
