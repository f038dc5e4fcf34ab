"""What the paper command writes under ``--out``, rewritten after every variant.

* ``results.json``: the header (hardware, meter, counter period, windows, plan), every
  variant's record (its repeats' figures and their summary), skipped shapes, the claims;
* ``claims.json``: a list with one object per claim (``claim`` 1-7, ``title``, ``verdict``,
  ``evidence``, ``notes``, ``figures``, ``sources``), for the first profile; other profiles' answers ride along under
  ``other_profiles``;
* ``claims.md``: the claims table, then each claim's checks;
* at the end, at most four plots (:mod:`refspec.eval.paper.plots`).

Every file is written atomically (:func:`refspec.eval.outputs.write_atomic`), so a run killed
at any moment leaves the last complete version. At most eight files, none in a folder, so all
come back from a lent machine.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from refspec.eval.outputs import write_atomic
from refspec.eval.paper import acceptance
from refspec.eval.paper.claims import evaluate

MAX_FILES, MAX_FILE_BYTES = 8, 16 << 20


def energy_label(sources: list[str]) -> str:
    """``measured (nvml-total-energy(gpu0))`` or ``MODELLED (...)``: never a model called measured."""
    kinds = sorted(set(sources))
    kind = "measured" if kinds and all(s.startswith("measured:") for s in kinds) else "MODELLED"
    return f"{kind} ({', '.join(s.split(':', 1)[-1] for s in kinds) or 'no energy'})"


class Outputs:
    """The results document and the files written from it.

    Args:
        out: the output folder.
        header: the run's header (hardware, meter, plan, ...).
        contexts: per profile label, what its claims need: ``profile`` (the roofline), ``source``
            (the meter's source), ``measured`` and ``clocks_read_only``.
    """

    def __init__(self, out: Path, header: dict[str, Any], contexts: dict[str, dict[str, Any]]) -> None:
        self.out = out
        self.data: dict[str, Any] = {**header, "variants": [], "skipped": [], "complete": False}
        self.contexts = contexts
        out.mkdir(parents=True, exist_ok=True)

    # ---- updates ------------------------------------------------------------------------------
    def add(self, variant: dict[str, Any]) -> None:
        self.data["variants"].append(variant)
        self.save()

    def skip(self, block: str, batch: int | None, drafter: str | None, why: str) -> None:
        self.data["skipped"].append({"block": block, "batch": batch, "drafter": drafter, "why": why})
        self.save()

    # ---- the claims ---------------------------------------------------------------------------
    def claims(self) -> list[dict[str, Any]]:
        """claims.json's list: the first profile's claims, the others under ``other_profiles``."""
        per = {label: self._claims_of(label) for label in self.contexts}
        labels = list(per)
        out = []
        for i, c in enumerate(per[labels[0]]):
            out.append({**c, "profile": labels[0],
                        "other_profiles": [{"profile": lab, **{k: per[lab][i][k] for k in ("verdict", "evidence",
                                                                                           "figures", "sources")}}
                                           for lab in labels[1:]]})
        return out

    def _claims_of(self, label: str) -> list[dict[str, Any]]:
        ctx = self.contexts[label]
        mine = [v for v in self.data["variants"] if v["profile"] == label]
        return evaluate(mine, profile=ctx["profile"], tau_table=acceptance.tau_table(),
                        published=acceptance.published_corpus_taus(), clocks_read_only=ctx["clocks_read_only"],
                        sources=sources_of(ctx, mine))

    def save(self) -> None:
        claims = self.claims()
        self.data["claims"] = claims
        write_atomic(self.out / "results.json", json.dumps(self.data, indent=1, default=str) + "\n")
        write_atomic(self.out / "claims.json", json.dumps(claims, indent=1, default=str) + "\n")
        write_atomic(self.out / "claims.md", claims_markdown(claims, self.data))

    def problems(self) -> list[str]:
        """What under ``out`` would not come back from a lent machine."""
        files = [p for p in self.out.rglob("*") if p.is_file() and not p.name.startswith(".")]
        found = [f"{len(files)} files, at most {MAX_FILES} come back"] if len(files) > MAX_FILES else []
        found += [f"{p.name} is over {MAX_FILE_BYTES} B" for p in files if p.stat().st_size >= MAX_FILE_BYTES]
        found += [f"{p.relative_to(self.out)} is in a folder" for p in files if p.parent != self.out]
        return found


def sources_of(ctx: dict[str, Any], variants: list[dict[str, Any]]) -> Callable[[int], list[str]]:
    """claim -> the sources of its numbers: which counter measured them, what is modelled, what injected."""
    from refspec.eval.record_figures import describe_source

    energy = sorted({v.get("energy_source") or ctx["source"] for v in variants if "error" not in v}) or [ctx["source"]]
    kind = "measured" if all(s.startswith("measured:") for s in energy) else "MODELLED"
    window = (f"energy: {kind}, {'; '.join(describe_source(s) for s in energy)}; read over each run's steady-state "
              "window (every slot busy), validity per variant")
    clock = ("time: the engine clock (CUDA-event phase times), TPOT/TTFT per request" if ctx["measured"]
             else "time: the modelled clock of the roofline profile (MODELLED)")
    origins = sorted({f"{v['source']}: {v['origin']}" for v in variants if v.get("origin")})
    injected = "acceptance: INJECTED (" + "; ".join(origins) + ")" if origins else "acceptance: plain decoding only"
    phases = ("per-phase energy: attributed (phase-isolated loops at each shape, a non-negative fit over the counter's "
              "sub-windows; method per variant)" if kind == "measured" or ctx.get("simulated")
              else "per-phase energy: modelled")
    ridge = f"ridge and verify intensity: MODELLED (roofline of the recorded verify shapes, {ctx['profile'].name})"
    table = (f"tau per corpus: measured on smollm2-135m with this project's shipped heads (CPU; "
             f"{acceptance.TAU_TABLE_FILE.name}); published DFlash figures per corpus (NVIDIA Model-Optimizer)")
    per = {1: [window, injected], 2: [window, injected], 3: [table, "not measurable on random-weight targets: their "
                                                             "acceptance is injected"],
           4: [window, phases, injected], 5: [window, injected, ridge], 6: [window, clock, injected],
           7: ["SM clock: NVML, read passively; never set" if ctx["clocks_read_only"] else "no GPU clocks here"]}
    return lambda n: per[n]


MODEL_BANNER = (
    "> **These verdicts restate the model.** No energy counter was read: every energy figure is the roofline's "
    "(through a simulated counter) and acceptance is injected, so the verdicts of claims marked *model consequence* "
    "follow from the roofline's arithmetic and the injected figures; they test that the code computes what the model "
    "says, not that the hardware behaves so. A GPU run would add energy read by the GPU's counter over steady-state "
    "windows, phase shares attributed from that counter, and times on the engine clock: costs the roofline does not "
    "see (kernel launches, attention kernels, clocks) could then make a verdict fail.")


def claims_markdown(claims: list[dict[str, Any]], data: dict[str, Any]) -> str:
    """claims.md: the banner of a modelled run, the table with each claim's evidence, then each claim's checks."""
    others = [f"verdict ({o['profile']})" for o in (claims[0]["other_profiles"] if claims else [])]
    modelled = any(c["evidence"] == "model consequence" for c in claims)
    lines = [f"# The paper's claims on {data.get('hardware', '?')}", "",
             f"Energy: {data.get('energy_label', '?')}. Acceptance: INJECTED (random-weight targets). "
             f"Profile: {claims[0]['profile'] if claims else '?'}. Run "
             f"{'complete' if data.get('complete') else 'in progress or cut'} ({len(data['variants'])} variants, "
             f"{len(data['skipped'])} shapes skipped, {data.get('repeats', '?')} repeats per variant).", "",
             *([MODEL_BANNER, ""] if modelled else []),
             "| " + " | ".join(["claim", "verdict", *others, "evidence", "what"]) + " |",
             "|---" * (4 + len(others)) + "|"]
    for c in claims:
        others = "".join(f" {o['verdict']} |" for o in c["other_profiles"])
        lines.append(f"| {c['claim']} | **{c['verdict']}** |{others} {c['evidence']} | {c['title']} |")
    for c in claims:
        lines += ["", f"## Claim {c['claim']}: {c['title']}", "",
                  f"Verdict: **{c['verdict']}** ({c['profile']}); evidence: {c['evidence']}", ""]
        lines += [f"- note: {n}" for n in c.get("notes", [])]
        for ch in c["figures"]["checks"]:
            nums = ", ".join(f"{k} {v}" for k, v in ch.items() if k not in ("check", "verdict", "targets"))
            lines.append(f"- {ch['verdict']}: {ch['check']}" + (f" ({nums})" if nums else ""))
        for x in c["figures"].get("crossover", []):
            b = x["crossover_batch"]
            lines.append(f"- crossover {x['arch']} {x['drafter']} ({x['source']} acceptance): "
                         f"{x['note'] if b is None or not x['note'].startswith('log') else f'batch {b:.1f}'}"
                         f" (savings by batch: {', '.join(f'{k}: {100 * v:+.1f}%' for k, v in x['savings'].items())})")
        lines += ["", "Sources: " + "; ".join(c["sources"])]
    return "\n".join(lines) + "\n"


__all__ = ["Outputs", "energy_label", "claims_markdown", "MODEL_BANNER", "MAX_FILES"]
