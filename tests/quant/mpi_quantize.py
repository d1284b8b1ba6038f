"""Run under ``mpiexec -n N``: ``llmkit quantize ARGS``, one rank per process (what ``mpiexec -n N
llmkit quantize ...`` runs; test_multirank_mpi.py launches it with the shared ``run_mpi``)."""

import sys

from llmkit.cli import main

sys.exit(main(["quantize", *sys.argv[1:]]))
