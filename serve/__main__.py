"""``python -m refspec.serve``: see :mod:`refspec.serve.cli`."""
import sys

from refspec.serve.cli import main

sys.exit(main())
