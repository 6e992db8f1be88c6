"""Adapters to the field's evaluation harnesses (docs/design.md, "Harnesses"): lm-evaluation-harness's
``expertcast`` model over the offloading runtime (:mod:`.lm_eval_adapter`) and its task files that read the
local benchmark copies (:mod:`.local_tasks`, ``tasks/``). Imports no Lightning, wandb or train/."""
