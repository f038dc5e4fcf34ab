"""Hand-built run records for tests of the report: flat JSON fields, the identity filled in."""
from __future__ import annotations

from typing import Any

from refspec.eval.record import RunRecord


def record(**fields: Any) -> RunRecord:
    """A record from flat JSON fields (record version 4 unless ``record_version`` says otherwise)."""
    return RunRecord.from_json({"record_version": 4, "config_id": "c", "model": "tiny", "drafter": "none", "k": 0,
                                "batch": 1, "corpus": "c", **fields})


def with_fields(r: RunRecord, **fields: Any) -> RunRecord:
    """``r`` with some of its JSON fields replaced."""
    return RunRecord.from_json({**r.to_json(), **fields})
