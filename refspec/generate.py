"""``python -m refspec.generate``: the command lives at the CLI edge, in ``refspec.eval.generate``."""
import sys

if __name__ == "__main__":
    from refspec.eval.generate import main

    sys.exit(main())
