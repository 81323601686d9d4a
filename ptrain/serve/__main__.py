"""`python -m ptrain.serve`: the command line of ptrain/serve/cli.py."""

import sys

from ptrain.serve.cli import main

sys.exit(main())
