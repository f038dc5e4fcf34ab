"""A record's JSON object before it becomes a :class:`~refspec.eval.record.RunRecord`: the field
names of older versions under today's, and the JSON types of its scalar fields."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

V3_NAMES = {"emitted": "run_tokens", "total_time_s": "run_time_s", "total_energy_j": "run_energy_j",
            "tokens_per_s": "run_tokens_per_s", "mean_active_rows": "run_mean_active_rows",
            "energy_per_token_j_run": "run_j_per_token", "energy_per_token_j": "window_j_per_token",
            "net_energy_j": "run_net_energy_j", "net_energy_per_token_j": "run_net_j_per_token",
            "window_s": "window_time_s", "phase_energy_per_token_j": "phase_j_per_token"}
"""Version 3's names of fields renamed in version 4."""
V2_NAMES = {**V3_NAMES, "energy_per_token_j": "run_j_per_token", "rows": "requests",
            "prompts_unique": "requests_unique"}
"""Version 2's (its ``energy_per_token_j`` is the run's, not the window's)."""
_SCALARS = {"float": (int, float), "int": (int,), "str": (str,), "bool": (bool,)}


def upgrade(d: dict[str, Any], version: int) -> dict[str, Any]:
    """``d`` under the current names (version 2 and 3 records wrote the run's and the window's J/token
    as ``energy_per_token_j``; version 2's is the run's)."""
    if version >= 4:  # version 4 lacks only fields that read as None
        return d
    names = V2_NAMES if version == 2 else V3_NAMES
    out = {names.get(k, k): v for k, v in d.items() if not (version == 3 and k in ("rows", "prompts_unique"))}
    if isinstance(out.get("baseline"), Mapping):
        out["baseline"] = {names.get(k, k): v for k, v in out["baseline"].items()}
    return out


def mistyped(cls: type, d: Mapping[str, Any], prefix: str = "") -> str | None:
    """The first number, string or flag field of dataclass ``cls`` (JSON names ``prefix + name``)
    that ``d`` gives another JSON type, described; None when every one is right."""
    for f in dataclasses.fields(cls):
        value = d.get(prefix + f.name)
        kinds = [k.strip() for k in str(f.type).split("|") if k.strip() != "None"]
        if value is None or not kinds or not set(kinds) <= set(_SCALARS):
            continue  # absent, or not a scalar field (mappings, tuples, sections)
        if not any(isinstance(value, _SCALARS[k]) and (k == "bool" or not isinstance(value, bool)) for k in kinds):
            return f"{prefix + f.name} is {value!r}, not {' or '.join(kinds)}"
    return None


__all__ = ["V2_NAMES", "V3_NAMES", "upgrade", "mistyped"]
