# %% [markdown]
# # Lecture 5: verification, not drafting, dominates the energy
#
# **Claim 4.** On dense models, verification, not drafting, dominates energy.
#
# A trained drafter such as EAGLE runs K small forwards per step: one decoder layer of the
# target's width, a fc layer, and the target's LM head (the vocabulary projection). The target
# then verifies in one forward of all its layers. In a memory-bound step, a forward costs
# about the bytes it reads, so the comparison is: K times (one layer + fc + LM head) against the
# whole target once. For Llama-3.1-8B that is 3 x 0.8 GB against 16 GB. Speculation's cost is
# mostly the *target's* work, which is why acceptance (lecture 3) and the batch (lecture 1) decide
# everything, and a cheaper drafter cannot rescue a bad configuration.
#
# The claim has a condition hidden in its numbers, and a small model shows it: SmolLM2-135M has
# a 49,152-word vocabulary for a hidden size of 576, so its LM head (28 M parameters) is a fifth
# of the whole model, and the draft head reads it K times per step.
#
# **Measured, modelled or injected?** The SmolLM2 runs **measure** the drafts and their
# acceptance on this CPU; every energy is **modelled** by the H100 roofline from the forwards
# that ran (each forward's recorded shape, so the draft phase is priced from the head's real
# forwards). The Llama-3.1-8B curves are **modelled** at an **injected** acceptance.

# %%
import os

QUICK = os.environ.get("REFSPEC_COURSE_QUICK") == "1"  # the test suite's short run of this lecture
TOKENS = 16 if QUICK else 64
BATCHES = (1, 4) if QUICK else (1, 16)

# %% [markdown]
# ## 1. The phase shares of a real run
#
# `phase_share` is each phase's share of the energy the phases drew (prefill, draft, verify,
# commit); the line items that no phase holds (`unattributed`) are outside it.

# %%
from refspec.eval import lab

smol = lab.load("smollm2-135m", meter="roofline:h100")
runs = {b: smol.run("eagle", k=4, batch=b, corpus="code", requests=2 * b, max_new_tokens=TOKENS, output_len="fixed")
        for b in BATCHES}
runs[BATCHES[0]]

# %% key
for b, r in runs.items():
    print(f"SmolLM2 + EAGLE, batch {b}: draft {r.phase_share['draft']:.1%}, verify {r.phase_share['verify']:.1%}")

# %% [markdown]
# ## 2. Why: bytes per forward
#
# The roofline's cost of one draft forward and one verify forward, at batch 1, for SmolLM2 and
# for Llama-3.1-8B with its EAGLE head.

# %%
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import EAGLE_HEAD, predict_step

h100 = get_profile("h100")
K, A, CONTEXT = 4, 0.7, 512
for name, args, nbytes in (("smollm2-135m (fp32, as run)", smol.args, smol.dtype_bytes),
                           ("llama-3.1-8b (bf16)", arch("llama-3.1-8b"), 2)):
    p = predict_step(args, h100, batch=1, k=K, context=CONTEXT, acceptance=A, drafter=EAGLE_HEAD, dtype_bytes=nbytes)
    share = p.verify_energy_j / p.step_energy_j
    print(f"{name:<28} K draft forwards {p.draft_energy_j * 1e3:8.2f} mJ, verify {p.verify_energy_j * 1e3:8.2f} mJ: "
          f"verify {share:.0%} of the step")

# %% [markdown]
# ## 3. Across the batch, on Llama-3.1-8B

# %%
llama = arch("llama-3.1-8b")
BATCH_AXIS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
verify_share = [(lambda p: p.verify_energy_j / p.step_energy_j)(
    predict_step(llama, h100, batch=b, k=K, context=CONTEXT, acceptance=A)) for b in BATCH_AXIS]

# %% key
print(f"llama-3.1-8b + EAGLE K={K}: verify share at batch 1: {verify_share[0]:.1%}")
print(f"llama-3.1-8b + EAGLE K={K}: verify share at batch 256: {verify_share[-1]:.1%}")

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.semilogx(BATCH_AXIS, [100 * s for s in verify_share], "o-", label="verify")
ax.semilogx(BATCH_AXIS, [100 - 100 * s for s in verify_share], "s-", label="draft")
for b, r in runs.items():
    ax.plot([b], [100 * r.phase_share["verify"] / (r.phase_share["verify"] + r.phase_share["draft"])], "k^")
ax.set_xlabel("batch")
ax.set_ylabel("% of draft + verify energy")
ax.set_title("Llama-3.1-8B + EAGLE (modelled, H100); triangles: SmolLM2 runs")
ax.legend()
plt.show()

# %% [markdown]
# As the batch grows the verify forward's cost grows with the tokens it computes (B (K + 1)),
# the head's with B: verification's share rises further. On SmolLM2 at batch 1 the head's LM
# head makes drafting a large part of the step: "dominates" is a statement about targets whose
# layers outweigh one layer plus the vocabulary projection, as every model the paper studied does.
#
# ## What a GPU run would change
#
# A GPU counter cannot see a phase: it measures the run's total over windows of tens of
# milliseconds, and the draft and verify phases of one step last milliseconds. The split this
# claim is about then has to be *attributed* (phase-isolated loops and a fit over sub-windows),
# and an attribution can fail: lecture 8. On a GPU the draft head's forwards are also less
# efficient than the model's (small matrices, one launch each), which raises drafting's share.
#
# ## Exercises
#
# 1. Give SmolLM2's EAGLE head a reduced draft vocabulary of 8,192 rows
#    (`DrafterModel(name="eagle-8k", lm_head_rows=8192)`, as EAGLE-3 heads do). What is
#    verify's share now?
# 2. For a mixture-of-experts target (`arch("qwen3-30b-a3b")`), what is verify's share at batch
#    1? Why is it higher than for Llama-3.1-8B?
# 3. Is "verification dominates" a good reason to make the drafter cheaper, or to make it
#    better? Argue from the figures above.
#
# <details><summary>Answers</summary>
#
# 1. From about half to about two thirds of the step (pass `dtype_bytes=smol.dtype_bytes` and
#    `drafter=` to `predict_step`): the head's largest matrix was the 49,152-row LM head; at
#    8,192 rows a draft forward reads far fewer bytes.
# 2. About 86 % against Llama's 71 %: the verify forward's K + 1 tokens per request route to
#    several experts each, so it reads many experts' weights (up to all 128 per layer), while the
#    draft head is one dense layer of the model's width with its LM head.
# 3. Better: drafting is a small share, so halving its cost saves little; every accepted draft
#    removes a whole verify step's worth of target work per token.
#
# </details>
