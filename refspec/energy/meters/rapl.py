"""CPU package and DRAM energy from RAPL, read through Linux's powercap sysfs.

Each RAPL domain is a directory under ``/sys/class/powercap``: ``intel-rapl:N`` a CPU package
(its ``name`` file says ``package-N``), ``intel-rapl:N:M`` a domain inside or beside it
(``core``, ``uncore``, ``dram``). Each holds ``energy_uj``, a cumulative counter in microjoules
that wraps to 0 after ``max_energy_range_uj``, and updates about every millisecond. Intel and
recent AMD CPUs expose it; since 2020 reading ``energy_uj`` usually needs root (or a udev rule
making it readable).

By default the counter reads every package and every DRAM domain: ``core`` and ``uncore`` lie
inside their package and would count twice, and ``psys`` (the whole platform) contains them all.
Each domain is a device of the counter (``package-0``, ``dram-0``), so the ledger records them
apart and sums them; the source names them: ``measured:rapl(package-0,dram-0)``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from refspec.energy.meters.counters import Device, DeviceCounter, Unwrap
from refspec.energy.meters.errors import NoCounterError

logger = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
RAPL_PERIOD_S = 0.001
"""RAPL's energy counters update about every millisecond."""
DEFAULT_DOMAINS = ("package", "dram")


@dataclasses.dataclass(frozen=True)
class RaplZone:
    """One RAPL domain.

    Attributes:
        device: device name in records, ``package-0`` or ``<domain>-<package>`` (``dram-0``).
        domain: the domain's own name (``package``, ``dram``, ``core``, ``psys`` ...).
        path: its powercap directory.
        max_range_uj: where ``energy_uj`` wraps, in uJ.
    """

    device: str
    domain: str
    path: Path
    max_range_uj: int


def _zone(path: Path, parent: str | None) -> RaplZone | None:
    try:
        name = (path / "name").read_text().strip()
        max_range = int((path / "max_energy_range_uj").read_text())
    except (OSError, ValueError) as exc:
        logger.debug("skipping powercap zone %s: %r", path, exc)
        return None
    domain = name.split("-")[0]
    if parent is None:
        device = name
    else:
        device = f"{name}-{parent.rsplit('-', 1)[-1]}" if parent.startswith("package-") else f"{name}-{parent}"
    return RaplZone(device=device, domain=domain, path=path, max_range_uj=max_range)


def rapl_zones(root: str | Path = POWERCAP_ROOT) -> list[RaplZone]:
    """Every RAPL domain under ``root``: each package (``intel-rapl:N``) followed by its subzones
    (``intel-rapl:N:M``), in directory order; unreadable metadata skips a zone."""
    root = Path(root)
    zones: list[RaplZone] = []
    for top in sorted(root.glob("intel-rapl:*")):
        if top.name.count(":") != 1:
            continue
        zone = _zone(top, None)
        if zone is None:
            continue
        zones.append(zone)
        # sysfs lists a subzone both beside its package (a link) and inside its directory
        subs = {p.name: p for p in [*top.glob(f"{top.name}:*"), *root.glob(f"{top.name}:*")]}
        for name in sorted(subs):
            subzone = _zone(subs[name], zone.device)
            if subzone is not None:
                zones.append(subzone)
    return zones


def _reader(zone: RaplZone) -> Callable[[], float]:
    """Cumulative J of ``zone`` since the first call, wrap-around unwrapped."""
    unwrap = Unwrap(zone.max_range_uj)
    path = zone.path / "energy_uj"
    return lambda: unwrap(int(path.read_text())) * 1e-6


def rapl_counter(domains: Sequence[str] | None = None, *, root: str | Path = POWERCAP_ROOT,
                 clock: Callable[[], float] = time.perf_counter) -> DeviceCounter:
    """A counter over the RAPL domains of this machine.

    Args:
        domains: domain names or device names to read (``package``, ``dram``, ``package-1``,
            ``core`` ...); default every package and every DRAM domain.
        root: the powercap directory (a fake tree in tests).
        clock: time base of the reads.

    Raises:
        NoCounterError: no RAPL domain under ``root``, none of ``domains``, or ``energy_uj``
            cannot be read (permissions); the message says which and how to fix it.
    """
    zones = rapl_zones(root)
    if not zones:
        raise NoCounterError(f"no RAPL counter: {root} has no readable intel-rapl zone (not Linux, no RAPL "
                             f"driver, or a virtual machine)")
    wanted = tuple(domains) if domains else DEFAULT_DOMAINS
    chosen = [z for z in zones if z.domain in wanted or z.device in wanted]
    if not chosen:
        raise NoCounterError(f"no RAPL zone matches {', '.join(wanted)} under {root}; there are "
                             f"{', '.join(z.device for z in zones)}")
    for z in chosen:
        try:
            int((z.path / "energy_uj").read_text())
        except PermissionError:
            raise NoCounterError(f"RAPL's {z.path / 'energy_uj'} is readable by root only; run as root or make "
                                 f"it readable (e.g. a udev rule: chmod a+r on intel-rapl energy_uj)") from None
        except (OSError, ValueError) as exc:
            raise NoCounterError(f"cannot read {z.path / 'energy_uj'}: {exc}") from None
    devices = [Device(z.device, "rapl", _reader(z)) for z in chosen]
    return DeviceCounter(devices, period_s=RAPL_PERIOD_S, clock=clock)


def rapl_available(root: str | Path = POWERCAP_ROOT) -> bool:
    """Whether a RAPL package counter can be read under ``root``."""
    try:
        rapl_counter(("package",), root=root)
    except NoCounterError as exc:
        logger.debug("%s", exc)
        return False
    return True


__all__ = ["RaplZone", "rapl_zones", "rapl_counter", "rapl_available", "POWERCAP_ROOT", "RAPL_PERIOD_S"]
