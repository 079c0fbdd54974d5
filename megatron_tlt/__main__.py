"""`python -m megatron_tlt` is the `megatron-tlt` command."""

import sys

from megatron_tlt.cli import main

if __name__ == "__main__":
    sys.exit(main())
