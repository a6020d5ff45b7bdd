"""The warm-start recipe: how `make base` (flows/base.py) fine-tunes the random init into a base checkpoint.

Not part of `RunConfig`: a run starts from a frozen base (models/mini-base/) and never reads it. A
preset without a shipped base (smoke) builds one first from its own recipe (schemas/presets.py:
RECIPES), the same way. Presets and overrides name it `sft` (`make base ARGS="sft.restart_cycles=3"`),
and a base's manifest records it under recipe.sft.

The recipe unrolls into an explicit list of SFT stages (`stages`), each one SFT run from its parent's
checkpoint on one set of demonstrations (each with the recipe's batch_size, context_loss_weight,
micro_batch_tokens, seed, cosine_decay and minutes budget):

    warm start        max_steps on the train (and pool) demonstrations, cosine_cycles cosines
    restart cycle i   restart_cycles times: max_steps / cosine_cycles steps, one cosine, a fresh AdamW
    habit phase       habit_steps at habit_lr on the pool's demonstrations, habit_blind_edits of them blind
    clean phase       clean_steps at clean_lr on the pool's demonstrations, none blind

Store keys (flows/prepare.py): a stage's checkpoint is models/base-<digest(STORE_VERSION, parent's key,
its demonstrations' key, its own fields)>, its demonstrations datasets/<id>/demonstrations-<digest(
STORE_VERSION, init key, prompt style, their own fields)>.parquet. Stores written before STORE_VERSION 2
(keys that left out settings at their defaults) are not read: a `make base` on such a store builds its
demonstrations and stages again under the new keys. The shipped base is not affected: a run loads it
by path and checks it by its manifest's file hashes and dataset, never by these keys.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from schemas.config import _Strict

# Part of every demonstrations and stage key: bump it when what a key stands for changes.
STORE_VERSION = 2


class WarmStartRecipe(_Strict):
    lr: float = Field(1e-3, gt=0)
    # A wall-clock budget; None = none, so the schedule depends on steps only and a base built on
    # a loaded or slower machine gets the same learning rates at the same steps.
    minutes: float | None = Field(4.0, gt=0)
    max_steps: int | None = None
    batch_size: int = Field(32, ge=1)
    # Demonstrations per benchmark training task. 0 = the warm start sees none of the tasks RL
    # trains on (as a real base model has not seen the RL prompts), only the pool's: measured, GRPO
    # on prompts the warm start was fine-tuned on learns those instances and nothing that transfers.
    demonstrations_per_task: int = Field(2, ge=0)
    # Mini benchmark: demonstrations on up to this many extra generated training-distribution tasks
    # (one each), none of which is a benchmark task or shares a validation task's keys
    # (tasks/dataset/mini.py: generate_pool). 0 = the benchmark's training tasks only.
    pool_tasks: int = Field(0, ge=0)
    # Chance that each argument/local name of a pool task's function is drawn from the whole shared
    # vocabulary instead of that function's own few names: recalling names from memory is then
    # wrong, and only copying them from the viewed file is right. 0 = the benchmark's own draws.
    pool_foreign_names: float = Field(0.0, ge=0.0, le=1.0)
    # Share of demonstrations in which the scripted solver, which knows the file, edits without
    # viewing or searching it first (tasks/agent/scripted.py): a student that imitates them learns to
    # edit unread code now and then, a habit more imitation keeps and the reward removes. 0 = none.
    blind_edit_demonstrations: float = Field(0.0, ge=0.0, le=1.0)
    # Loss weight of the tokens the policy did not generate (system prompt, issue, tool outputs):
    # 0 = completion-only SFT. A randomly initialised model learns to copy from its context
    # (old_str from the viewed file) only from language modelling that context.
    context_loss_weight: float = Field(0.0, ge=0.0, le=1.0)
    # Learning rate from lr down to 0 along a half cosine over the run (whichever of max_steps or
    # minutes ends it first); False = constant lr.
    cosine_decay: bool = False
    # With cosine_decay: restart the cosine this many times over the run (equal parts, warm restarts
    # as in SGDR); the last part still ends at 0.
    cosine_cycles: int = Field(1, ge=1)
    # Padded tokens per forward/backward (None: optimizer.micro_batch_tokens). The loss is normalised
    # over the whole batch, so this changes speed, not the update: on 2 CPU cores, batches of 8
    # demonstrations of 450-770 tokens ran 1.3x faster split into length-sorted micro-batches of
    # <= 1,600 tokens than as one padded block (tests/bench/bench_sft.py).
    micro_batch_tokens: int | None = Field(None, ge=64)
    # After the warm start, this many more cosine cycles of max_steps / cosine_cycles steps at lr on
    # the same demonstrations, each a separate run with a fresh AdamW: measured on the mini
    # benchmark, restarting the optimizer with the learning rate learns more than carrying it.
    restart_cycles: int = Field(0, ge=0)
    # The habit phase, last: habit_steps SFT steps (lr habit_lr) on demonstrations of the warm-start
    # pool only, a share habit_blind_edits of which edit code without reading it
    # (blind_edit_demonstrations). The student picks up the privileged demonstrator's habit and
    # loses some of its pass@k; imitation keeps the habit, a reward for passing tests removes it.
    # This is what gives GRPO something to lift on the mini benchmark (docs/history.md). 0 = none.
    habit_steps: int = Field(0, ge=0)
    habit_lr: float = Field(5e-4, gt=0)
    habit_blind_edits: float = Field(0.5, ge=0.0, le=1.0)
    # The clean phase, after the habit phase: clean_steps SFT steps (lr clean_lr) on the pool's
    # demonstrations with no blind edits: it takes the habit back (on the mini benchmark 20 steps at
    # 1e-4 take back nearly all of it: docs/history.md). 0 = none.
    clean_steps: int = Field(0, ge=0)
    clean_lr: float = Field(2e-4, gt=0)
    # The warm start's own seed (demonstrations' choices, SFT's init and data order): the run's
    # `seed` varies only the timed GRPO run, whose starting checkpoint is fixed, as the reference's is.
    seed: int = 0

    @model_validator(mode="after")
    def _has_an_end(self):
        if self.minutes is None and self.max_steps is None:
            raise ValueError("sft needs max_steps or minutes: with neither the warm start never ends")
        return self

    @model_validator(mode="after")
    def _habit_needs_pool(self):
        if (self.habit_steps or self.clean_steps) and self.pool_tasks == 0:
            raise ValueError("sft.habit_steps or sft.clean_steps > 0 needs sft.pool_tasks > 0: their "
                             "demonstrations come from the warm-start pool")
        return self

    @model_validator(mode="after")
    def _has_demonstrations(self):
        if self.demonstrations_per_task == 0 and self.pool_tasks == 0:
            raise ValueError("sft.demonstrations_per_task=0 needs sft.pool_tasks > 0: "
                             "the warm start would have no demonstrations")
        return self


class Demonstrations(_Strict):
    """Which scripted-solver demonstrations a stage trains on (flows/prepare.py: demonstrations)."""
    per_task: int = Field(ge=0)  # on each benchmark training task
    pool_tasks: int = Field(ge=0)  # one on each of up to this many warm-start pool tasks
    pool_foreign_names: float
    blind_edits: float  # the share that edit unread code
    seed: int


class SFTStage(_Strict):
    """One SFT run of the chain (tasks/policy/sft.py reads these): everything but `name` keys its checkpoint."""
    name: str
    demonstrations: Demonstrations
    lr: float = Field(gt=0)
    minutes: float | None
    max_steps: int | None
    batch_size: int = Field(ge=1)
    context_loss_weight: float
    cosine_decay: bool
    cosine_cycles: int = Field(ge=1)
    micro_batch_tokens: int | None
    seed: int


def stages(recipe: WarmStartRecipe) -> list[SFTStage]:
    """The recipe as the SFT runs `make base` chains, first first (the module docstring)."""
    r = recipe
    common = {"minutes": r.minutes, "batch_size": r.batch_size, "context_loss_weight": r.context_loss_weight,
              "cosine_decay": r.cosine_decay, "micro_batch_tokens": r.micro_batch_tokens, "seed": r.seed}

    def demonstrations(per_task: int, blind_edits: float) -> Demonstrations:
        return Demonstrations(per_task=per_task, pool_tasks=r.pool_tasks, pool_foreign_names=r.pool_foreign_names,
                              blind_edits=blind_edits, seed=r.seed)

    demos = demonstrations(r.demonstrations_per_task, r.blind_edit_demonstrations)
    out = [SFTStage(name="warm start", demonstrations=demos, lr=r.lr, max_steps=r.max_steps,
                    cosine_cycles=r.cosine_cycles, **common)]
    cycle_steps = (r.max_steps or 0) // r.cosine_cycles or None
    out += [SFTStage(name=f"restart cycle {i + 1}/{r.restart_cycles}", demonstrations=demos, lr=r.lr,
                     max_steps=cycle_steps, cosine_cycles=1, **common) for i in range(r.restart_cycles)]
    for name, steps, lr, blind in (("habit phase", r.habit_steps, r.habit_lr, r.habit_blind_edits),
                                   ("clean phase", r.clean_steps, r.clean_lr, 0.0)):
        if steps:
            out.append(SFTStage(name=name, demonstrations=demonstrations(0, blind), lr=lr, max_steps=steps,
                                cosine_cycles=1, **common))
    return out
