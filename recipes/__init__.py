"""The recipe room (docs/design.md "Layout"): the jobs' bodies that live beside their commands, above the library.

Only ``cli.py``, ``commands/`` and ``scripts/`` import it: the embedded default model's training recipe
(:mod:`.tiny_default`), the disk tier's benchmark (:mod:`.bench_disk`) and the SAEM stages study (:mod:`.saem_eval`).
"""
