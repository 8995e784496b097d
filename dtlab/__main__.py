"""``python -m dtlab`` is the ``dtlab`` command (also under torchrun and mpiexec)."""

import sys

from dtlab.cli import main

sys.exit(main())
