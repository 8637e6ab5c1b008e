"""`python -m dynatrain_megatron.cli ARGS`: the `dynatrain` command."""
import sys

from . import main

sys.exit(main())
