# %% [markdown]
# # Lecture 0: the ledger, or what one step does and what each phase costs
#
# Speculative decoding makes a target model emit several tokens per forward: a cheap
# **drafter** guesses the next K tokens of every request, the target **verifies** all of them
# in one forward (K + 1 positions per request), pure functions **accept** the longest prefix the
# target agrees with and add one token of the target's own (the bonus), and the engine
# **commits** what was kept. Every new request is read once first (**prefill**).
#
# The claims of this course are all statements about energy per output token, and refspec
# computes that figure in one place only: the accounting reads the **ledger**, one JSON line per
# phase of every step, and divides the energy of all phases by the tokens emitted. Rejected
# drafts earn nothing: *only accepted tokens count*.
#
# In this lecture you run SmolLM2-135M (a real model, small enough for a laptop) with the
# n-gram drafter (it copies continuations from the prompt: free to run, good on code), open its
# ledger, and recompute J/token by hand.
#
# **Measured, modelled or injected?** The tokens, the drafts and their acceptance are
# **measured**: SmolLM2 really ran on this CPU. Time and energy are **modelled**: the meter
# `roofline:h100` prices each forward the model ran (its FLOPs and bytes) on a data-sheet H100
# and charges static power over the modelled time. Nothing is injected.

# %%
import os

QUICK = os.environ.get("REFSPEC_COURSE_QUICK") == "1"  # the test suite's short run of this lecture
REQUESTS, TOKENS = (4, 24) if QUICK else (16, 64)

# %% [markdown]
# ## 1. A run through the Python API
#
# `lab.load` names the target and the meter; `run` serves a stream of requests from a corpus
# (here HumanEval's code prompts) on `batch` slots kept busy, as a server would, and returns a
# `Report`: the accounting's figures as one object.

# %%
from refspec.eval import lab

smol = lab.load("smollm2-135m", meter="roofline:h100")
r = smol.run("ngram", k=4, batch=2, corpus="code", requests=REQUESTS, max_new_tokens=TOKENS, output_len="fixed")
r

# %% [markdown]
# ## 2. The ledger
#
# `r.ledger` is the JSONL file the run wrote; `r.run_ids` names its run. Every phase of every
# step is one record: which step, which phase, how many rows were active, what was drafted,
# accepted and emitted, how long it took and what it cost (here: what the H100 model charged
# for the forwards it recorded in `work`). A prefill carries step -1 (or the step it refilled).

# %%
from refspec.energy.ledger.read import read_ledger

records = [x for x in read_ledger(r.ledger) if x.get("run_id") in r.run_ids]
phases = [x for x in records if x["kind"] == "phase"]
print(f"{'step':>4} {'phase':<8} {'rows':>4} {'drafted':>7} {'accepted':>8} {'emitted':>7} {'time us':>8} {'mJ':>8}")
for x in phases[:14]:
    print(f"{x['step']:>4} {x['phase']:<8} {x['rows_active']:>4} {x['drafted']:>7} {x['accepted']:>8} "
          f"{x['emitted']:>7} {x['time_s'] * 1e6:>8.1f} {x['energy_j'] * 1e3:>8.3f}")

# %% [markdown]
# ## 3. J/token by hand
#
# Only accepted tokens count: add the energy of every phase (prefill included) and divide by
# every token emitted. tau, the acceptance length, is what one verify step gives one request:
# accepted drafts plus the bonus token, per active row and step.

# %%
energy = sum(x["energy_j"] for x in phases)
emitted = sum(x["emitted"] for x in phases)
verifies = [x for x in phases if x["phase"] == "verify"]
row_steps = sum(x["rows_active"] for x in verifies)
accepted = sum(x["accepted"] for x in verifies)
print(f"by hand:        J/token over the run {energy / emitted:.5f}, tau {(accepted + row_steps) / row_steps:.3f}")
print(f"the accounting: J/token over the run {r.j_per_token_run:.5f}, tau {r.tau:.3f}")

# %% key
print(f"J/token (run): {r.j_per_token_run:.5f}")
print(f"J/token (window): {r.j_per_token_window:.5f}")
print(f"tau: {r.tau:.3f}")
print(f"verify share: {r.phase_share['verify']:.1%}")

# %% [markdown]
# The run's J/token counts the ramp-up (the first prefills) and the drain (the last requests
# finishing while slots fall empty). A server runs in steady state, so comparisons use the
# **window** J/token: the steps during which every slot was busy and the stream still
# refilling. `r.window_valid` says whether that window can be trusted (long and full enough).

# %% [markdown]
# ## 4. Where the energy went, step by step
#
# Each bar is one step; its colours are its phases. Prefill bars are the refills of freed slots.

# %%
import matplotlib.pyplot as plt
from collections import defaultdict

per_step = defaultdict(lambda: defaultdict(float))
for x in phases:
    per_step[x["step"]][x["phase"]] += x["energy_j"] * 1e3
steps = sorted(per_step)[:40]
bottom = [0.0] * len(steps)
fig, ax = plt.subplots(figsize=(9, 3))
for phase in ("prefill", "draft", "verify", "commit"):
    heights = [per_step[s][phase] for s in steps]
    ax.bar(range(len(steps)), heights, bottom=bottom, label=phase)
    bottom = [b + h for b, h in zip(bottom, heights)]
ax.set_xticks(range(len(steps)), steps, fontsize=6)
ax.set_xlabel("step")
ax.set_ylabel("mJ (modelled, H100)")
ax.legend()
plt.show()

# %% [markdown]
# ## 5. The line items close on the total
#
# The accounting also splits the energy into line items: draft energy kept or spent on rejected
# drafts, verify energy on useful positions or on rejected ones (in proportion to positions),
# prefill, commit, other, unattributed. They must add up to the total: a check that fails
# loudly if anything is counted twice or lost.

# %%
for name, joules in r.line_items_j.items():
    print(f"{name:<16} {joules:10.4f} J")
print(f"{'sum':<16} {sum(r.line_items_j.values()):10.4f} J   total {r.energy_j:.4f} J")

# %% [markdown]
# ## 6. The same files from the command line
#
# The lab wrote `records.jsonl` and `ledger.jsonl` into its folder, exactly what
# `python -m refspec.eval run --out DIR` writes, so the command-line report reads it. A
# researcher would run `python -m refspec.eval --corpus code --batch 2 --meter roofline:h100 --out DIR`
# and get the same table.

# %%
import subprocess
import sys

table = subprocess.run([sys.executable, "-m", "refspec.eval", "report", str(smol.out)], capture_output=True,
                       text=True, check=True).stdout
print(table[:2500])

# %% [markdown]
# ## What a GPU run would change
#
# On an NVIDIA GPU with `meter="auto"`, time is measured (CUDA events) and energy is read from
# the GPU's own counter (NVML, through Zeus). That counter updates every 20-100 ms, far slower
# than a phase, so the per-phase column of the ledger is then *attributed*, not read (lecture 8).
# The figures of this lecture would move (SmolLM2 is tiny for an H100 and its forwards would be
# dominated by launch overheads); the bookkeeping would not.
#
# ## Exercises
#
# 1. Recompute the **window** J/token by hand. Which steps does the window hold? (Hint: the
#    record's `window` section: `r.record.window`.)
# 2. Run plain decoding (`smol.run("none", batch=2, ...)` with the same stream). Which phase
#    disappears, and how do J/token and the verify phase's share change?
# 3. The n-gram drafter has no forwards. Why does the draft phase still appear in the ledger,
#    and what does it cost under the roofline meter?
#
# <details><summary>Answers</summary>
#
# 1. `r.record.window.first_step` and `last_step` bound it; sum the energy and emitted tokens
#    of the phase records whose step lies in that range and divide. The result equals
#    `r.j_per_token_window` (`docs/serving.md` defines the window exactly).
# 2. The draft phase goes (k = 0: no drafter), every verify computes one position per row,
#    tau is 1.000. On code J/token is higher than with n-gram: each plain step reads every
#    weight for one token per request, where the n-gram steps got about `r.tau` tokens for
#    slightly more than one read.
# 3. The engine still brackets the phase (looking up the prompt is host work); the ledger
#    records it with no forwards, and the roofline meter charges only modelled forwards, so its
#    energy is 0 J. A measured counter would see the host's time between forwards.
#
# </details>
