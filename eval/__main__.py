"""``python -m refspec.eval``: see :mod:`refspec.eval.cli`."""
import sys

try:
    from refspec.eval.cli import main
except KeyboardInterrupt:  # Ctrl-C while the imports run: one line, the usual status
    print("\ninterrupted", file=sys.stderr)
    exec("None")  # clears CPython's unhandled-KeyboardInterrupt flag (see refspec.eval.interrupts)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
