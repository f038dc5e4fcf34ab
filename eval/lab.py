"""A small Python API for lessons and notebooks: a model, a drafter on prompts, the accounting as one object.

::

    from refspec.eval import lab

    smol = lab.load("smollm2-135m", meter="roofline:h100")
    r = smol.run("ngram", k=4, batch=1, corpus="code", requests=8, max_new_tokens=64, compare=True)
    r                      # J/token (window and run), tau, phases, the saving against plain decoding
    r.tau, r.j_per_token_window, r.phase_share["verify"], r.requests[0].energy_j

A run goes through eval's one pipeline (:func:`refspec.eval.run.run_configuration`: the engine
serves a request stream, the ledger is written, read back from disk and accounted by
:mod:`refspec.energy.accounting`) and lands in the lab's folder as ``records.jsonl`` and
``ledger.jsonl``, the files ``python -m refspec.eval run --out DIR`` writes, so
``python -m refspec.eval report DIR`` reads a lab's runs too. A :class:`Report` copies the
record's figures under flat names; it computes none of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from refspec.eval.flags import UsageError
from refspec.eval.outputs import RunPaths, claimed
from refspec.eval.record import RunRecord
from refspec.eval.run import prepare_configuration, resolve_defaults, run_configuration
from refspec.eval.run_config import RunConfig
from refspec.eval.runtime import pick_device
from refspec.eval.session import Session


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestFigures:
    """One request of a run: its tokens, energy, acceptance and latencies.

    Attributes:
        id: the request's id in the stream.
        output_tokens: tokens it was given (the prefill's first included).
        energy_j: its share of the run's energy, J (None under a time-only meter).
        j_per_token: ``energy_j / output_tokens``, J.
        acceptance_length: its own tau (accepted + 1 per verify step).
        ttft_s: time to its first token, s; tpot_s: time per output token after it, s.
    """

    id: int
    output_tokens: int | None
    energy_j: float | None
    j_per_token: float | None
    acceptance_length: float | None
    ttft_s: float | None
    tpot_s: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """How a counter's total was split among phases (a run under a counter meter only).

    Attributes:
        method: how the phases got their energy (``loops``, ``fit``, ``measured-total-only``, ...).
        gate_passed: whether the split passed the accounting's gate; None where this accounting
            reports no gate.
        gate_reasons: why it failed (empty when it passed or no gate is reported).
        additivity_residual: the loops' prediction of the run against the counter's total, relative.
        agreement: loops against fit, where both exist.
        interaction_residual: the interleaved step loop against the isolated loops, relative
            (None where not run).
        interaction_points: that residual times the step phases' part of the split, in points:
            the most it moves a share when it adds to every phase it touches (the gate allows 3).
        share_true: the simulated counter's true shares (a simulated counter only).
        share_naive: each phase's own counter difference, as shares (a simulated counter only).
    """

    method: str | None
    gate_passed: bool | None
    gate_reasons: tuple[str, ...]
    additivity_residual: float | None
    agreement: Any
    interaction_residual: float | None
    interaction_points: float | None
    share_true: Mapping[str, float] | None
    share_naive: Mapping[str, float] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """One configuration's figures, copied from its run record (``docs/fields.md`` defines each).

    Attributes:
        label: ``<drafter> k<K> b<B>`` (``none b<B>`` for plain decoding).
        model, drafter, k, batch, corpus: what ran.
        energy_source: where the energy came from, in words (measured by which counter, or modelled).
        measured: whether every energy figure was measured by a counter.
        time_source: ``wall-clock`` or ``modelled`` (a roofline meter of a named GPU models time too).
        requests: requests served; tokens: tokens emitted over the run.
        tau: acceptance length (accepted + bonus per active row per verify step).
        acceptance_rate: accepted / drafted.
        tokens_per_s: tokens emitted per second over the run.
        tpot_p50_s, tpot_p99_s: time per output token per request, s.
        j_per_token_window: J/token over the steady-state window (every slot busy); the figure a
            comparison uses. window_valid / window_note: whether the window can be trusted, and why not.
        j_per_token_run: J/token over the whole run (ramp-up and drain included).
        energy_j: the run's total energy, J.
        phase_share: each phase's share of the phases' energy (the residual items excluded).
        phase_energy_j: each phase's energy, J.
        line_items_j: the run's energy in line items (prefill, draft kept/rejected, verify
            useful/rejected, commit, other, unattributed), J; they close on ``energy_j``.
        rejected_energy_j: energy charged to rejected drafts, J: verify energy pro rata per verified
            position, draft energy per drafted token (an average cost; the marginal cost of a draft
            in a memory-bound step is far smaller).
        named_items_j: energy no request caused, by name (empty slots, no request, outside phases), J.
        split: the split of a counter's total among phases (None without a counter).
        per_request: each request's figures.
        saving_vs_plain: 1 - J/token / plain J/token (window); negative is a loss. None unless compared.
        speedup_vs_plain: tokens/s / plain tokens/s. None unless compared.
        plain: the plain-decoding report it was compared with.
        ledger: the JSONL ledger holding the run; run_ids: its runs in that ledger.
        record: the full run record (:class:`refspec.eval.record.RunRecord`).
    """

    label: str
    model: str
    drafter: str
    k: int
    batch: int
    corpus: str
    energy_source: str | None
    measured: bool | None
    time_source: str | None
    requests: int | None
    tokens: int | None
    tau: float | None
    acceptance_rate: float | None
    tokens_per_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    j_per_token_window: float | None
    window_valid: bool | None
    window_note: str | None
    j_per_token_run: float | None
    energy_j: float | None
    phase_share: Mapping[str, float]
    phase_energy_j: Mapping[str, float]
    line_items_j: Mapping[str, float]
    rejected_energy_j: float | None
    named_items_j: Mapping[str, float]
    split: Split | None
    per_request: tuple[RequestFigures, ...]
    saving_vs_plain: float | None
    speedup_vs_plain: float | None
    plain: "Report | None"
    ledger: Path
    run_ids: tuple[str, ...]
    record: RunRecord = dataclasses.field(compare=False)

    @classmethod
    def of(cls, record: RunRecord, *, label: str, ledger: Path, plain: "Report | None" = None) -> "Report":
        """The report of ``record`` (its configuration's ``label``, its ledger file), compared with ``plain``."""
        e, w, c = record.energy, record.window, record.comparison
        return cls(
            label=label, model=record.model, drafter=record.drafter, k=record.k, batch=record.batch,
            corpus=record.corpus, energy_source=e.energy_source_text, measured=e.energy_measured,
            time_source=record.time_source, requests=record.stream.requests, tokens=record.run.tokens,
            tau=record.counts.tau, acceptance_rate=record.counts.acceptance_rate,
            tokens_per_s=record.run.tokens_per_s, tpot_p50_s=record.latency.tpot_p50_s,
            tpot_p99_s=record.latency.tpot_p99_s, j_per_token_window=w.j_per_token if w else None,
            window_valid=w.valid if w else None, window_note=(w.invalid_reason or w.note) if w else None,
            j_per_token_run=record.run.j_per_token, energy_j=record.run.energy_j,
            phase_share=dict(e.phase_share or {}), phase_energy_j=dict(e.phase_energy_j or {}),
            line_items_j=dict(e.line_items_j or {}), rejected_energy_j=e.rejected_energy_j,
            named_items_j=dict(record.per_request.request_unattributed_j or {}), split=_split(record),
            per_request=tuple(RequestFigures(id=o.id, output_tokens=o.output_tokens, energy_j=o.energy_j,
                                             j_per_token=o.j_per_token, acceptance_length=o.acceptance_length,
                                             ttft_s=o.ttft_s, tpot_s=o.tpot_s) for o in record.request_outputs),
            saving_vs_plain=c.energy_saving_vs_baseline, speedup_vs_plain=c.speedup_vs_baseline, plain=plain,
            ledger=ledger, run_ids=tuple(record.stream.run_ids or ()), record=record)

    def __repr__(self) -> str:
        return "\n".join(_lines(self))


def _split(record: RunRecord) -> Split | None:
    """The phase split of a run under a counter meter, from the record's attribution (None without one)."""
    a = record.energy.attribution
    if not a:
        return None
    gate = a.get("split_gate") or {}
    return Split(method=record.energy.phase_energy_method, gate_passed=gate.get("passed"),
                 gate_reasons=tuple(gate.get("reasons") or ()), additivity_residual=a.get("additivity_residual"),
                 agreement=a.get("agreement"), interaction_residual=a.get("interaction_residual"),
                 interaction_points=a.get("interaction_points"),
                 share_true=record.energy.phase_share_true, share_naive=record.energy.phase_share_naive)


def _g(x: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else format(x * scale, spec) + unit


def _shares(shares: Mapping[str, float] | None) -> str:
    return "  ".join(f"{p} {v:.1%}" for p, v in (shares or {}).items()) or "n/a"


def _lines(r: Report) -> list[str]:
    """The readable summary of a report, one figure per line."""
    window = "" if r.window_valid else f" (window not valid: {r.window_note})"
    corpus = Path(r.corpus).name if "/" in r.corpus else r.corpus  # a prompt file by its name
    out = [f"{r.label} on {corpus} ({r.model}), {r.requests} requests, {r.tokens} tokens",
           f"  energy: {r.energy_source}; time: {r.time_source}",
           f"  J/token: window {_g(r.j_per_token_window, '.4g')}{window}, run {_g(r.j_per_token_run, '.4g')}",
           f"  tau {_g(r.tau, '.3f')}, acceptance {_g(r.acceptance_rate, '.1%')}, {_g(r.tokens_per_s, '.4g')} tok/s, "
           f"TPOT p50 {_g(r.tpot_p50_s, '.3g', 1e3, ' ms')}",
           f"  phases (share of the phases' energy): {_shares(r.phase_share)}"]
    if r.rejected_energy_j is not None and r.energy_j:
        out.append(f"  charged to rejected drafts pro rata (an average, not what fewer drafts would save): "
                   f"{r.rejected_energy_j / r.energy_j:.1%} of the energy")
    if r.split is not None:
        gate = ("no gate reported" if r.split.gate_passed is None else "gate passed" if r.split.gate_passed
                else "gate failed: " + "; ".join(r.split.gate_reasons))
        out.append(f"  split of the counter's total: {r.split.method} ({gate})")
    if r.plain is not None:
        s = r.saving_vs_plain
        verdict = "n/a" if s is None else f"saves {s:.1%}" if s >= 0 else f"costs {-s:.1%} more"
        out.append(f"  vs plain decoding: {verdict} J/token (window) at {_g(r.speedup_vs_plain, '.2f')}x the tokens/s")
    return out


class Lab:
    """A loaded target and meter that runs drafters on request streams and returns :class:`Report` s.

    Args:
        model: model id (``python -m refspec.eval assets list``) or Hugging Face directory.
        meter: the ``--meter`` spec: ``auto`` (a counter where one is readable, else the roofline
            of this CPU), ``roofline:h100`` (modelled energy and time of an H100), ``simulated:...``,
            ``time``.
        dtype: ``fp32``, ``bf16``, ``fp16``, or None: bf16 on a GPU, fp32 on a CPU (greedy outputs
            then equal plain decoding's token for token).
        device: ``auto``, ``cpu``, ``cuda``.
        out: folder of the lab's ``records.jsonl`` and ``ledger.jsonl`` (default: a new temporary folder).
        seed: the runs' sampling seed.
        phase_loops_s: seconds of each phase-isolated loop after a run under a counter (None: the
            accounting's floor; 0: none).

    Raises:
        UsageError: an unknown device or dtype.
    """

    def __init__(self, model: str = "smollm2-135m", *, meter: str = "auto", dtype: str | None = None,
                 device: str = "auto", out: str | Path | None = None, seed: int = 0,
                 phase_loops_s: float | None = None) -> None:
        dev = pick_device(device)
        self.dtype = dtype or ("bf16" if dev.type == "cuda" else "fp32")
        self.meter = meter
        self.seed = seed
        self.out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="refspec-lab-"))
        self.paths = RunPaths.for_task(self.out, None)
        self.session = Session(model=model, dtype=self.dtype, device=dev, meter=meter, progress=False,
                               phase_loops_s=phase_loops_s)
        self._plain: dict[str, Report] = {}

    @property
    def model(self) -> str:
        """The target's id or directory."""
        return self.session.model_name

    @property
    def args(self) -> Any:
        """The target's architecture (:class:`refspec.config.ModelArgs`; loads the target), for roofline predictions."""
        return self.session.target.model.args

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight element of the runs (4 for fp32, 2 for bf16)."""
        return self.session.dtype_bytes

    def run(self, drafter: str = "none", *, k: int | None = None, batch: int = 1, corpus: str = "code",
            prompts: Sequence[str] | None = None, requests: int | None = None, max_new_tokens: int = 64,
            output_len: str = "auto", temperature: float = 0.0, options: Mapping[str, str] | None = None,
            compare: bool = False) -> Report:
        """Serve a request stream with ``drafter`` and account it.

        Args:
            drafter: a registered drafter (``ngram``, ``eagle``, ``eagle3``, ``block``, ``draft-model``,
                ``MODULE:CLASS``) or ``none`` for plain decoding.
            k: drafts per step (default: the drafter's; 0 for ``none``).
            batch: slots kept busy B.
            corpus: a built-in corpus (``code``, ``conversation``, ``english``, ``romansh``, ...).
            prompts: your own prompts (chat messages) instead of a corpus.
            requests: requests served (default: one per prompt given, else 4 x batch); they cycle
                through the prompts.
            max_new_tokens: the budget cap of each request.
            output_len: how budgets are drawn below the cap (``auto``, ``fixed``, ``uniform:R``, ``reference``).
            temperature: 0 is greedy.
            options: drafter options (``--drafter-option``), e.g. ``{"tree": "true"}``.
            compare: also run plain decoding on the same stream (once per setting and lab) and
                fill ``saving_vs_plain`` and ``speedup_vs_plain``.

        Raises:
            UsageError: a setting that cannot run (a corpus, a batch, a budget beyond the model's
                context, ...), before anything runs.
            refspec.drafting.DrafterError: an unknown drafter, or one that cannot be built for the target.
        """
        if k is None:
            from refspec.drafters import registry

            k = 0 if drafter == "none" else registry.default_k(drafter)
        if prompts is not None and requests is None:
            requests = len(prompts)
        cfg = RunConfig(model=self.model, drafter=drafter, k=k, batch=batch,
                        corpus=self._prompt_file(prompts) if prompts is not None else corpus, num_prompts=None,
                        max_new_tokens=max_new_tokens, dtype=self.dtype, device=str(self.session.device),
                        meter=self.meter, temperature=temperature, seed=self.seed,
                        cuda_graphs=self.session.cuda_graphs, drafter_options=tuple(sorted((options or {}).items())),
                        requests=requests, output_len_dist=output_len)
        cfg = resolve_defaults(self.session, cfg)
        prepare_configuration(self.session, cfg)
        plain = self._plain_report(cfg.baseline()) if compare and not cfg.is_baseline else None
        return self._run(cfg, plain)

    def _plain_report(self, cfg: RunConfig) -> Report:
        if cfg.config_id not in self._plain:
            prepare_configuration(self.session, cfg)
            self._plain[cfg.config_id] = self._run(cfg, None)
        return self._plain[cfg.config_id]

    def _run(self, cfg: RunConfig, plain: Report | None) -> Report:
        with claimed(self.out, flag="lab out"), warnings.catch_warnings():
            # progress bars are off; in a notebook without ipywidgets tqdm.auto would still warn on import
            warnings.filterwarnings("ignore", message="IProgress not found")
            result = run_configuration(self.session, cfg, ledger_path=self.paths.ledger,
                                       records_path=self.paths.records,  # appended inside its aborted-marking rule
                                       baseline=plain.record if plain is not None else None)
        report = Report.of(result.record, label=cfg.label, ledger=self.paths.ledger, plain=plain)
        if cfg.is_baseline:
            self._plain.setdefault(cfg.config_id, report)
        return report

    def _prompt_file(self, prompts: Sequence[str]) -> str:
        """A prompt file in the lab's folder holding ``prompts`` (the corpus the CLI would read)."""
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise UsageError("prompts: give a list of non-empty strings")
        lines = "".join(json.dumps({"prompt": p, "kind": "chat"}) + "\n" for p in prompts)
        path = self.out / f"prompts-{hashlib.sha256(lines.encode()).hexdigest()[:10]}.jsonl"
        self.out.mkdir(parents=True, exist_ok=True)
        path.write_text(lines)
        return str(path)

    def __repr__(self) -> str:
        return f"Lab({self.model!r}, meter={self.meter!r}, dtype={self.dtype!r}, out={str(self.out)!r})"


def load(model: str = "smollm2-135m", **settings: Any) -> Lab:
    """A :class:`Lab` of ``model`` (the target loads on the first run); ``settings`` as :class:`Lab` takes them."""
    return Lab(model, **settings)


__all__ = ["Lab", "Report", "RequestFigures", "Split", "load"]
