"""``python -m lightning_ckpt.cli``."""

import sys

from lightning_ckpt.cli.main import main

sys.exit(main())
