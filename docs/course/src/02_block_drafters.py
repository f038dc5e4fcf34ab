# %% [markdown]
# # Lecture 2: block drafters cross the ridge
#
# **Claim 5.** The saving shrinks as the batch grows; at large batch, block drafters push
# verification past the roofline's balance point into the compute-bound regime, where the
# saving becomes a loss.
#
# A chain drafter (EAGLE) proposes K tokens in K small forwards, one after the other; K is
# usually 3 to 7. A **block drafter** (DFlash and other diffusion-style drafters) proposes a whole
# block of K tokens in one forward, so long blocks are cheap to draft: K = 15 is typical, and at
# batch 1 such drafters reach 6 or more tokens per step. But the target must still verify K + 1
# positions per request. Lecture 1 showed the verify step's intensity grows like B (K + 1): with
# K = 15 it reaches the H100's ridge at a batch four times smaller than with K = 3.
#
# **Measured, modelled or injected?** The curves are **modelled** (the roofline of a data-sheet
# H100, Llama-3.1-8B as the target) at **injected** acceptance rates. Section 3 runs SmolLM2's
# own block head on this CPU: its acceptance is **measured**, its energy modelled.

# %%
import os

QUICK = os.environ.get("REFSPEC_COURSE_QUICK") == "1"  # the test suite's short run of this lecture
REQUESTS, TOKENS = (1, 16) if QUICK else (8, 96)

# %% [markdown]
# ## 1. Two drafters on one target
#
# The drafters are described by what one draft forward costs (`DrafterModel`): EAGLE is one
# decoder layer of the target with a fc layer over two hidden states and the LM head, run K
# times; the block drafter is five decoder layers fed with five target layers' features, run once
# for all K tokens (`parallel=True`).

# %%
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import EAGLE_HEAD, DrafterModel, compute_bound_batch, predict_step

target, h100 = arch("llama-3.1-8b"), get_profile("h100")
BLOCK = DrafterModel(name="block-5layer", layers=5, fc_inputs=5, parallel=True)
CONTEXT = 512
DRAFTERS = {"EAGLE K=3, a=0.7": (EAGLE_HEAD, 3, 0.7), "block K=15, a=0.85": (BLOCK, 15, 0.85)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def saving(drafter, k, a, batch):
    spec = predict_step(target, h100, batch=batch, k=k, context=CONTEXT, acceptance=a, drafter=drafter)
    plain = predict_step(target, h100, batch=batch, k=0, context=CONTEXT, acceptance=a)
    return 1 - spec.j_per_token / plain.j_per_token, spec


rows = {name: {b: saving(d, k, a, b) for b in BATCHES} for name, (d, k, a) in DRAFTERS.items()}
print(f"{'batch':>5}" + "".join(f"{name:>22}" for name in DRAFTERS) + "   (saving; tokens per step)")
for b in BATCHES:
    print(f"{b:>5}" + "".join(f"{rows[n][b][0]:>15.1%} ({rows[n][b][1].tokens_per_row:.2f})" for n in DRAFTERS))

# %% [markdown]
# The block drafter saves more at batch 1 (more tokens per step, one cheap draft forward) and
# loses sooner. Where exactly? `loss_regions` (the roofline command's own search) finds the
# batches where speculation costs more J/token than plain decoding.

# %%
from refspec.eval.roofline_cli import loss_regions

regions = {name: loss_regions(target, h100, k=k, context=CONTEXT, acceptance=a, drafter=d)
           for name, (d, k, a) in DRAFTERS.items()}
ridge_batch = {name: compute_bound_batch(target, h100, k=k, context=CONTEXT) for name, (d, k, a) in DRAFTERS.items()}

# %% key
for name in DRAFTERS:
    first_loss = regions[name][0][0] if regions[name] else None
    print(f"{name}: verify compute-bound from batch {ridge_batch[name]}, loses from batch {first_loss}")
print(f"block saving at batch 1: {rows['block K=15, a=0.85'][1][0]:.1%}")
print(f"block saving at batch 64: {rows['block K=15, a=0.85'][64][0]:.1%}")

# %% [markdown]
# ## 2. The plot

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.8))
for i, name in enumerate(DRAFTERS):
    ax.semilogx(BATCHES, [100 * rows[name][b][0] for b in BATCHES], "o-", color=f"C{i}", label=name)
    ax.axvline(ridge_batch[name], ls=":", color=f"C{i}")
ax.axhline(0, color="k", lw=0.8)
ax.set_xlabel("batch (dotted: verify turns compute-bound)")
ax.set_ylabel("saving vs plain, % (modelled, H100)")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. A block drafter you can run: SmolLM2's
#
# refspec ships a block head for SmolLM2-135M (block size 8, so K <= 7), trained on a laptop-sized
# budget. Its acceptance on code, measured here, is far below a published DFlash head's. The
# cell converts the measured tau into the per-draft acceptance that gives the same tau
# (`acceptance_from_tau`) and asks the model where a block drafter that good would stop paying
# on Llama-3.1-8B.

# %%
from refspec.eval import lab
from refspec.eval.acceptance_models import acceptance_from_tau

smol = lab.load("smollm2-135m", meter="roofline:h100")
block = smol.run("block", k=7, batch=1, corpus="code", requests=REQUESTS, max_new_tokens=TOKENS, output_len="fixed")
a_measured = acceptance_from_tau(block.tau, 7)
small_block = DrafterModel(name="block-1layer", layers=1, fc_inputs=3, parallel=True)
lost = loss_regions(target, h100, k=7, context=CONTEXT, acceptance=a_measured, drafter=small_block)

# %% key
print(f"SmolLM2 block head, K=7, code: measured tau {block.tau:.3f}")
print(f"per-draft acceptance with that tau: {a_measured:.3f}")
print(f"loses from batch: {lost[0][0] if lost else None}")

# %% [markdown]
# ## What a GPU run would change
#
# A GPU run measures the energy (the counter over the steady-state window) instead of modelling
# it, and the real crossing depends on how close the verify kernels get to the data-sheet peak:
# attention over K + 1 query positions is less efficient than a large matrix product, so the
# loss starts earlier. Acceptance on a GPU would be the same as here for the same head and text
# (greedy decoding is deterministic up to rounding).
#
# ## Exercises
#
# 1. Give the block drafter K = 7 at the same acceptance 0.85. Does it lose later? What does it
#    give up at batch 1?
# 2. Make the block drafter free (`DrafterModel(name="free", fraction=0.0)`). Does the crossing
#    move? What does that say about where the loss comes from?
# 3. Why does a chain drafter with K = 15 behave worse than the block drafter at batch 1, though
#    the verify step is the same?
#
# <details><summary>Answers</summary>
#
# 1. It loses later (from batch 105 instead of 43: its verify crosses the ridge at batch 45
#    instead of 21) but saves less at batch 1 (73 % instead of 77 %): fewer tokens per step,
#    (1 - 0.85^8) / 0.15 = 4.8 against (1 - 0.85^16) / 0.15 = 6.2.
# 2. It moves to a larger batch (62 instead of 43) but a free drafter still loses: verifying
#    K + 1 positions per request in a compute-bound step is what turns the saving into a loss;
#    the drafter's own forwards only bring the loss forward.
# 3. Fifteen sequential draft forwards each read the head's weights and pay a launch overhead;
#    at batch 1 they are memory-bound and add up to a large part of the step. The block drafter
#    reads its weights once for all 15 tokens.
#
# </details>
