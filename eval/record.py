"""The run record: one configuration's identity and figures, typed, read and written here alone.

A :class:`RunRecord` is what ``records.jsonl`` holds one line of and ``summary.json`` a list
of. On disk it is one flat JSON object (``docs/fields.md`` describes every field); in Python
its figures are grouped into sections, each a frozen dataclass whose fields map one to one to
JSON names (the section's prefix + the field's name):

* ``run`` (``run_*``) and ``window`` (``window_*``): the figures that exist over the whole run
  and over the steady-state window (``run_j_per_token`` beside ``window_j_per_token``), so a
  name never means the one for the other;
* ``stream``, ``counts``, ``latency``, ``energy``, ``work``, ``per_request``, ``comparison``;
* ``host`` (``host_*``): how busy the host was while the configuration served.

:func:`RunRecord.from_json` reads the current :data:`RECORD_VERSION` and the older versions of
:data:`READABLE_VERSIONS` (renaming their fields, :mod:`refspec.eval.record_json`; a version 2
record, from before serving windows, has ``window`` None); any other version, and a field of the
wrong JSON type, is refused with one line (:class:`RecordError`).
Files of records: :mod:`refspec.eval.record_files`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from refspec.eval.record_json import mistyped, upgrade

RECORD_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)
"""Versions :meth:`RunRecord.from_json` reads: 2 (static lockstep runs, no window), 3 (the old names), 4 (no
``host_*`` fields nor verdict reliability: read as None)."""
Figures = Mapping[str, Any]


class RecordError(ValueError):
    """A record that cannot be read: another version, a field missing, not an object."""


def _section(prefix: str = "") -> Any:
    """A section's decorator: frozen, keyword-only, every field None unless given, JSON names ``prefix + name``."""
    def wrap(cls: type) -> type:
        for name in cls.__annotations__:
            setattr(cls, name, None)
        cls.PREFIX = prefix
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    return wrap


@_section()
class Stream:
    """What was served: schedule, requests, budgets, and the ledger runs that hold them."""

    PREFIX: ClassVar[str]
    schedule: str | None
    requests: int | None
    requests_unique: int | None
    request_rate: float | None
    max_new_tokens: int | None
    output_lengths: Figures | None
    stream_digest: str | None
    batches: int | None
    run_ids: tuple[str, ...] | None
    ledger: str | None


@_section()
class Counts:
    """The run's step counts, times and acceptance (the accounting's, pooled over its ledger runs)."""

    PREFIX: ClassVar[str]
    drafted: int | None
    accepted: int | None
    row_steps: int | None
    steps: int | None
    verified: int | None
    rejected_positions: int | None
    prefill_time_s: float | None
    phase_time_s: Figures | None
    tau: float | None
    acceptance_rate: float | None


@_section("run_")
class RunFigures:
    """Figures over the whole run, ramp-up and drain included (JSON ``run_*``)."""

    PREFIX: ClassVar[str]
    tokens: int | None
    time_s: float | None
    energy_j: float | None
    tokens_per_s: float | None
    mean_active_rows: float | None
    j_per_token: float | None
    net_energy_j: float | None
    net_j_per_token: float | None


@_section("window_")
class WindowFigures:
    """Figures over the steady-state window, every slot busy (JSON ``window_*``)."""

    PREFIX: ClassVar[str]
    first_step: int | None
    last_step: int | None
    bounds: tuple[Any, ...] | None
    steps: int | None
    time_s: float | None
    tokens: float | None
    energy_j: float | None
    mean_active_rows: float | None
    tokens_per_s: float | None
    j_per_token: float | None
    note: str | None
    valid: bool | None
    invalid_reason: str | None


@_section()
class Latency:
    """Per-request latency percentiles on the engine clock (s)."""

    PREFIX: ClassVar[str]
    rows_with_tpot: int | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None


@_section()
class Energy:
    """Where the energy came from and how it splits: phases, line items, their closure."""

    PREFIX: ClassVar[str]
    energy_source: str | None
    energy_measured: bool | None
    energy_source_text: str | None
    idle_w: float | None
    phase_energy_j: Figures | None
    phase_share: Figures | None
    phase_j_per_token: Figures | None
    line_items_j: Figures | None
    line_items_sum_j: float | None
    closure_error_j: float | None
    rejected_energy_j: float | None
    closes: bool | None
    unattributed_energy_j: float | None
    phase_energy_method: str | None
    phase_share_true: Figures | None
    phase_share_naive: Figures | None
    attribution: Figures | None


@_section()
class Work:
    """What decided a comparison besides speculation: refills, prefill work, experts, the K chosen."""

    PREFIX: ClassVar[str]
    refills: int | None
    refill_group_p50: float | None
    refill_group_max: int | None
    prefill_positions_per_request: float | None
    prefill_tokens_per_request: float | None
    prefill_positions_per_token: float | None
    experts_touched_per_step: float | None
    draft_experts_touched_per_step: float | None
    k_steps: Figures | None
    k_mean: float | None


@_section()
class PerRequest:
    """Energy and acceptance per request, summarised (each request's own figures: ``request_outputs``)."""

    PREFIX: ClassVar[str]
    request_energy_p50_j: float | None
    request_energy_p99_j: float | None
    request_j_per_token_p50: float | None
    request_j_per_token_p99: float | None
    request_energy_sum_j: float | None
    request_unattributed_j: Figures | None
    request_unattributed_share: float | None
    request_closure_error_j: float | None
    request_energy_closes: bool | None
    request_split_profile: str | None
    acceptance_hist: tuple[int, ...] | None
    acceptance_per_position: tuple[float | None, ...] | None
    acceptance_tau_from_positions: float | None


@_section()
class Comparison:
    """The comparison with the baseline at the same batch: saving, speed-up, greedy audit, prefill work."""

    PREFIX: ClassVar[str]
    baseline: Figures | None
    energy_saving_vs_baseline: float | None
    speedup_vs_baseline: float | None
    same_stream_as_baseline: bool | None
    greedy_match_baseline: bool | None
    greedy_rows_matching: int | None
    prefill_work_vs_baseline: float | None
    prefill_warning: str | None
    greedy_requests_compared: int | None
    greedy_requests_matching: int | None
    greedy_requests_near_tie: int | None
    greedy_requests_defect: int | None
    greedy_requests_unclassified: int | None
    greedy_requests_not_comparable: int | None
    greedy_near_ties: tuple[Figures, ...] | None
    greedy_defects: tuple[Figures, ...] | None
    greedy_near_tie_bound: str | None
    greedy_audit_baseline: str | None
    verdict_reliable: bool | None
    verdict_unreliable_reason: str | None


@_section("host_")
class Host:
    """The host while serving (JSON ``host_*``): load, CPU time over wall time, measured over modelled step time."""

    PREFIX: ClassVar[str]
    load_start: float | None
    load_end: float | None
    cpus: int | None
    threads: int | None
    cpu_s: float | None
    wall_s: float | None
    cpu_per_wall: float | None
    step_time_s: float | None
    model_step_time_s: float | None
    time_vs_model: float | None


@_section()
class RequestOutput:
    """One request: what was asked (id, prompt, budget, arrival) and what it got (tokens, figures)."""

    PREFIX: ClassVar[str]
    id: int
    prompt: tuple[int, ...] | None
    budget: int | None
    arrival_s: float | None
    tokens: tuple[int, ...]
    output_tokens: int | None
    energy_j: float | None
    j_per_token: float | None
    energy_by_phase_j: Figures | None
    energy_by_part_j: Figures | None
    verify_steps: int | None
    accepted_per_step: tuple[int, ...] | None
    accepted_hist: tuple[int, ...] | None
    acceptance_per_position: tuple[float | None, ...] | None
    acceptance_length: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None


SECTIONS: dict[str, type] = {"stream": Stream, "counts": Counts, "run": RunFigures, "window": WindowFigures,
                             "latency": Latency, "energy": Energy, "work": Work, "per_request": PerRequest,
                             "comparison": Comparison, "host": Host}
_EMPTY = {name: cls() for name, cls in SECTIONS.items() if name != "window"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One configuration's record (module docstring; fields: ``docs/fields.md``).

    ``window`` is None for a record without window fields (version 2, before steady-state windows).
    """

    config_id: str
    model: str
    drafter: str
    k: int
    batch: int
    corpus: str
    record_version: int = RECORD_VERSION
    status: str = "ok"
    config: Figures | None = None
    baseline_config_id: str | None = None
    spec_policy: str = "fixed"
    tree: bool = False
    dtype: str | None = None
    device: str | None = None
    meter: str | None = None
    temperature: float = 0.0
    greedy: bool = True
    seed: int | None = None
    cuda_graphs: bool | None = None
    compiled_step: bool | None = None
    threads: int | None = None
    time_source: str | None = None
    acceptance_injected: bool = False
    injection: Figures | None = None
    roofline: Figures | None = None
    output_digest: str | None = None
    row_digests: tuple[str, ...] | None = None
    request_outputs: tuple[RequestOutput, ...] = ()
    versions: Figures | None = None
    cpu_gemm_plan: str | None = None
    wall_s: float | None = None
    created_unix_s: float | None = None
    stream: Stream = _EMPTY["stream"]
    counts: Counts = _EMPTY["counts"]
    run: RunFigures = _EMPTY["run"]
    window: WindowFigures | None = None
    latency: Latency = _EMPTY["latency"]
    energy: Energy = _EMPTY["energy"]
    work: Work = _EMPTY["work"]
    per_request: PerRequest = _EMPTY["per_request"]
    comparison: Comparison = _EMPTY["comparison"]
    host: Host = _EMPTY["host"]

    @property
    def is_baseline(self) -> bool:
        return self.drafter == "none"

    @property
    def is_static(self) -> bool:
        """A lockstep (``--schedule static``) record, whose window figures are not shown."""
        return self.stream.schedule == "static"

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object of this record (current version)."""
        top = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SECTIONS}
        top["request_outputs"] = [_flat(o) for o in self.request_outputs]
        for name in SECTIONS:
            section = getattr(self, name)
            if section is not None:
                top.update(_flat(section))
        return {**top, "record_version": RECORD_VERSION}

    @classmethod
    def from_json(cls, obj: Any) -> "RunRecord":
        """The record of a JSON object of any version in :data:`READABLE_VERSIONS`.

        Raises:
            RecordError: not an object, another version, or an identity field missing.
        """
        if not isinstance(obj, Mapping):
            raise RecordError(f"a record is a JSON object, got {type(obj).__name__}")
        version = obj.get("record_version")
        if version not in READABLE_VERSIONS:
            raise RecordError(f"record {obj.get('config_id', '?')} has record_version {version!r}; this refspec reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}: rerun its sweep")
        d = upgrade(dict(obj), version)
        missing = [f for f in ("config_id", "model", "drafter", "k", "batch", "corpus") if d.get(f) is None]
        if missing:
            raise RecordError(f"record {d.get('config_id', '?')} lacks {', '.join(missing)}; a record written by hand "
                              f"or cut short? Rerun its sweep")
        for part in (cls, *SECTIONS.values()):  # the top fields, then each section's
            wrong = mistyped(part, d, getattr(part, "PREFIX", ""))
            if wrong:
                raise RecordError(f"record {d['config_id']}: {wrong}; a record written by hand? Rerun its sweep")
        top = {f.name: _tuple(d[f.name]) for f in dataclasses.fields(cls)
               if f.name not in SECTIONS and f.name in d and d[f.name] is not None}
        top["request_outputs"] = tuple(_read(RequestOutput, o) for o in d.get("request_outputs") or ())
        sections = {name: _read(sc, d) for name, sc in SECTIONS.items()}
        if not any(k.startswith(WindowFigures.PREFIX) for k in d):  # version 2: before steady-state windows
            sections["window"] = None
        return cls(**{**top, **sections, "record_version": RECORD_VERSION})



def _flat(section: Any) -> dict[str, Any]:
    return {section.PREFIX + f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _read(cls: type, d: Mapping[str, Any]) -> Any:
    return cls(**{f.name: _tuple(d.get(cls.PREFIX + f.name)) for f in dataclasses.fields(cls)})


def fields_of_json() -> list[str]:
    """Every JSON field name of a record, in order (``docs/fields.md`` describes each)."""
    top = [f.name for f in dataclasses.fields(RunRecord) if f.name not in SECTIONS]
    return top + [sc.PREFIX + f.name for sc in SECTIONS.values() for f in dataclasses.fields(sc)]


__all__ = ["RunRecord", "RequestOutput", "Stream", "Counts", "RunFigures", "WindowFigures", "Latency", "Energy",
           "Work", "PerRequest", "Comparison", "Host", "SECTIONS", "RecordError", "RECORD_VERSION", "READABLE_VERSIONS",
           "fields_of_json"]
