"""``python -m refspec.bench``: the benchmarks live at the CLI edge, in ``refspec.eval.bench``."""
import sys

if __name__ == "__main__":
    from refspec.eval.bench import main

    sys.exit(main())
