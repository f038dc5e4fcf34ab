"""One rank of ``python -m refspec.eval`` for tests/test_tp.py, optionally dying mid-run.

``TP_TEST_DIE_RANK=r`` and ``TP_TEST_DIE_AFTER=n``: rank r exits abruptly (``os._exit(3)``, as a
crashed or killed process would) at its n-th all-reduce, in the middle of a configuration.

Usage: python tests/tp_cli_worker.py ARGS... (the arguments of python -m refspec.eval)
"""
from __future__ import annotations

import os
import sys


def _die_later(after: int) -> None:
    from refspec.models.tp import shard as tp_module

    real = tp_module.all_reduce_
    calls = [0]

    def dying(tensor, group):
        calls[0] += 1
        if calls[0] >= after:
            os._exit(3)
        return real(tensor, group)

    tp_module.all_reduce_ = dying


if __name__ == "__main__":
    if os.environ.get("TP_TEST_DIE_RANK") == os.environ.get("RANK"):
        _die_later(int(os.environ["TP_TEST_DIE_AFTER"]))
    from refspec.eval.cli import main

    sys.exit(main(sys.argv[1:]))
