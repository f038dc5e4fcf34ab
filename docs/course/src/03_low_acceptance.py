# %% [markdown]
# # Lecture 3: low acceptance, and what a rejected draft really costs
#
# **Claim 2.** Every drafted token is verified whether it is accepted or not, so the saving
# depends on acceptance. **Claim 5, last part.** A low-acceptance drafter raises energy per token.
#
# The n-gram drafter copies what followed the last occurrence of the current few tokens in the
# prompt. On code it is often right (functions repeat their names and arguments); on a chat
# answer it rarely is. Its drafts cost nothing to make, but every one of them is verified.
#
# This lecture is also about a misreading. The accounting reports how much of the energy went
# to rejected drafts, and with n-gram on conversation that share is large. It is tempting to
# read "most drafts were rejected, so most of the energy was wasted". It was not, and the
# difference between the **average** and the **marginal** cost of a rejected draft is why.
#
# **Measured, modelled or injected?** Drafts and acceptance are **measured** (SmolLM2-135M runs
# here on the CPU, greedy). Energy and time are **modelled** by the roofline of an H100
# (`meter="roofline:h100"`), from the forwards that really ran. Nothing is injected.

# %%
import os

QUICK = os.environ.get("REFSPEC_COURSE_QUICK") == "1"  # the test suite's short run of this lecture
REQUESTS, TOKENS = (2, 32) if QUICK else (6, 64)

# %% [markdown]
# ## 1. Conversation against code, at batch 1

# %%
from refspec.eval import lab

smol = lab.load("smollm2-135m", meter="roofline:h100")
runs = {corpus: smol.run("ngram", k=4, batch=1, corpus=corpus, requests=REQUESTS, max_new_tokens=TOKENS,
                         output_len="fixed", compare=True)
        for corpus in ("conversation", "code")}
runs["conversation"]

# %% key
for corpus, r in runs.items():
    print(f"{corpus}: drafts rejected {1 - r.acceptance_rate:.1%}, "
          f"charged to rejected drafts {r.rejected_energy_j / r.energy_j:.1%}, "
          f"J/token {r.j_per_token_window:.5f} against plain {r.plain.j_per_token_window:.5f}, "
          f"saving {r.saving_vs_plain:.1%}")

# %% [markdown]
# On conversation nearly every draft is rejected, and the accounting charges a large share of
# the energy to rejected drafts. Yet n-gram decoding still costs *less* per token than plain
# decoding. Both figures are right; they answer different questions.
#
# ## 2. Average against marginal cost
#
# The accounting's line items split the verify step's energy among the positions it computed,
# **in proportion to positions**: a step that verified 5 positions for one request and kept 1
# charges 4/5 of its energy to rejected drafts. That is the **average** cost of a position,
# and it answers "what did the rejected positions consume, pro rata?".
#
# The question a designer asks is different: "how much would I save if I had not drafted that
# token?" That is the **marginal** cost: the verify forward with one position fewer. At batch
# 1 the step is memory-bound: its time is the time to read the weights once, and that read is
# paid for one position or five. One more position adds a few FLOPs and a little KV traffic.
#
# The model prices both. The context is the run's mean cache length.

# %%
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import forward_cost
from refspec.energy.model.work import ForwardShape

h100 = get_profile("h100")


def verify_energy(batch, positions, context):
    """Modelled energy (J) of one verify forward of ``positions`` tokens per row."""
    cost = forward_cost(ForwardShape(args=smol.args, rows=batch, tokens_per_row=positions,
                                     context_tokens=batch * (context + positions), dtype_bytes=smol.dtype_bytes))
    return h100.energy_j(cost, h100.time_s(cost))


conv = runs["conversation"]
context = conv.record.roofline["context"]
average = conv.line_items_j["verify_rejected"] / conv.record.counts.rejected_positions
marginal = verify_energy(1, 5, context) - verify_energy(1, 4, context)

# %% key
print(f"average cost of a rejected position: {average * 1e3:.3f} mJ")
print(f"marginal cost of the fifth position: {marginal * 1e3:.4f} mJ")
print(f"marginal / average: {marginal / average:.1%}")

# %% [markdown]
# So the share of energy "on rejected drafts" printed above means: had the verify step's
# energy been shared out per position, that much would fall on positions that were refuted.
# It does **not** mean that not drafting would have saved that much: dropping the drafts would
# save the marginal cost, a small fraction, while losing the occasional accepted draft, each of
# which saves a whole step. That is why a drafter with most of its drafts
# rejected can still lower J/token at batch 1.

# %% [markdown]
# ## 3. When low acceptance does cost energy
#
# The marginal cost is small against the average only while one weight read dominates the step.
# As the batch grows, that read is shared by more and more positions, while each extra position
# still pays its own FLOPs and KV traffic (in energy, even where they cost no time), and past the
# ridge it costs time as well. The model with each corpus's measured acceptance
# (`acceptance_from_tau`) shows where the saving turns into a loss as the batch grows (the
# n-gram drafter is free: `fraction=0`).

# %%
from refspec.energy.model.roofline import DrafterModel, predict_step
from refspec.eval.acceptance_models import acceptance_from_tau

FREE = DrafterModel(name="ngram", fraction=0.0)
BATCHES = [1, 4, 16, 64, 128, 256, 512, 1024]


def modelled_saving(a, batch):
    kw = dict(batch=batch, context=context, acceptance=a, drafter=FREE, dtype_bytes=smol.dtype_bytes)
    spec, plain = predict_step(smol.args, h100, k=4, **kw), predict_step(smol.args, h100, k=0, **kw)
    return 1 - spec.j_per_token / plain.j_per_token


acceptance = {corpus: acceptance_from_tau(r.tau, 4) for corpus, r in runs.items()}
curves = {corpus: [modelled_saving(a, b) for b in BATCHES] for corpus, a in acceptance.items()}
for corpus in curves:
    points = "  ".join(f"B{b} {s:+.0%}" for b, s in zip(BATCHES, curves[corpus]))
    print(f"{corpus:>12} (a = {acceptance[corpus]:.2f}): {points}")

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.6))
for corpus, ys in curves.items():
    ax.semilogx(BATCHES, [100 * y for y in ys], "o-", label=f"{corpus}: tau {runs[corpus].tau:.2f} (measured)")
ax.axhline(0, color="k", lw=0.8)
ax.set_xlabel("batch")
ax.set_ylabel("saving vs plain, % (modelled, H100)")
ax.set_title("n-gram K=4 on SmolLM2: measured acceptance, modelled energy")
ax.legend()
plt.show()

# %% [markdown]
# At large batch the marginal cost of a position approaches its average cost, rejected or not,
# and a drafter whose drafts are mostly rejected pays for K + 1 positions to get little more
# than one token. Low acceptance loses first.
#
# ## What a GPU run would change
#
# On a GPU the energy would be measured over the steady-state window, and the split among
# phases, hence the line items, attributed from the counter (lecture 8). The measured saving at
# batch 1 would be smaller than modelled: a real verify kernel over five positions costs more
# than the model's pure weight read. The average/marginal distinction would not change. The
# runs here are fp32 (4 bytes per weight, what a laptop runs exactly); a GPU run is bf16, which
# halves the bytes and moves the crossing to half the batch.
#
# ## Exercises
#
# 1. Compute the marginal cost of the fifth position at batch 256. How does it compare with
#    the average cost you measured, and why?
# 2. Run n-gram on conversation with K = 1 (`smol.run("ngram", k=1, ...)`). How do the rejected
#    share and the saving change?
# 3. A colleague proposes to report "energy wasted on rejected drafts" as the headline figure
#    of a drafter. What would you tell them?
#
# <details><summary>Answers</summary>
#
# 1. `(verify_energy(256, 5, context) - verify_energy(256, 4, context)) / 256` is about the
#    same per request as at batch 1 (the fifth position's FLOPs and KV bytes), but the average
#    cost of a position, `verify_energy(256, 5, context) / (256 * 5)`, has fallen by about 30x:
#    the weight read is now shared by 1,280 positions. The marginal cost is then most of the
#    average, and an unaccepted draft is nearly as expensive as it looks.
# 2. The energy charged to rejected drafts falls (one refuted position per step at most instead
#    of four), while the saving stays small: at batch 1 a step costs nearly the same with two
#    positions or five, and tokens per step hardly change when drafts are rarely accepted.
# 3. That it is an average, not a marginal figure: it says how the step's energy divides among
#    positions, not what drafting cost. Report J/token against plain decoding at the same batch
#    (the saving), which already counts every rejected draft, and quote the rejected share only
#    as a diagnostic.
#
# </details>
