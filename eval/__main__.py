"""``python -m refspec.eval``: see :mod:`refspec.eval.cli`."""
import sys

from refspec.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
