"""``python -m llmkit`` = the ``llmkit`` command (what ``llmkit train --nproc N`` runs under mpiexec)."""

import sys

from llmkit.cli import main

sys.exit(main())
