"""The recipe room (docs/design.md "Layout"): the jobs' bodies that live beside their commands, above the library.

Only ``cli.py``, ``commands/`` and ``scripts/`` import it: the embedded default model's training recipe
(:mod:`.tiny_default`, with its corpus and held-out measurements), the disk tier's benchmark (:mod:`.bench_disk`), the
SAEM stages study (:mod:`.saem_eval`), the two passes of ``expertcast collect`` (:mod:`.collect`) and a command's W&B
run with the inputs it consumed (:mod:`.lineage`).
"""
