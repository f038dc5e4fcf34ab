"""``python -m refspec.eval dvfs``: show the SM clocks a DVFS sweep can lock on this GPU."""
from __future__ import annotations

from typing import Sequence

from refspec.energy.meters.errors import NoGPUError
from refspec.energy.meters.dvfs import ZeusGPUBackend
from refspec.eval.flags import OneLineParser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: show a GPU's current and supported SM clocks (exit 0 with a message without a GPU)."""
    parser = OneLineParser(
        prog="python -m refspec.eval dvfs",
        description="Show the SM clocks DVFS sweeps can lock. Sweeps themselves run from refspec.eval, which "
                    "calls refspec.energy.meters.dvfs.dvfs_sweep with a measured workload; locks are reset on exit, "
                    "exception and Ctrl-C. Lock clocks only on a GPU of your own, never on a shared or lent "
                    "machine; this command only reads them.")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index")
    args = parser.parse_args(argv)
    try:
        backend = ZeusGPUBackend()
        clocks = backend.supported_sm_clocks(args.gpu)
        current = backend.sm_clock_mhz(args.gpu)
    except NoGPUError as exc:
        print(f"no GPU: {exc}. DVFS needs an NVIDIA GPU; nothing to do.")
        return 0
    print(f"gpu{args.gpu}: current SM clock {current} MHz; {len(clocks)} supported SM clocks "
          f"{clocks[0]}-{clocks[-1]} MHz: {clocks}")
    return 0
