"""``python -m areal_lightning.tools.demo --worker CONFIG.json --losses FILE``: one training run of the demo."""

import sys

from areal_lightning.tools.demo.train import _worker_main

sys.exit(_worker_main(sys.argv[1:]))
