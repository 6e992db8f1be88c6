"""SAEM, stage-aware expert management for chain-of-thought: stage detection and cue sets, stage-level
expert ranking, token repacking, CPU execution of cold experts (docs/design.md, "Layout")."""
