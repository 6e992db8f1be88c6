"""One record per trace layout: :class:`FormatSpec` (docs/design.md, "Trace importers").

Every question "is this file layout F, what must the user tell its import, how is it read" reads the layout's
spec. Each importer module ends with ``SPEC = FormatSpec(...)`` beside its parser;
:mod:`expertcast.data.importers` builds the registry from the modules named in its ``FORMAT_MODULES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.data.importers.common import Imported, ImportOptions

FLAGS = {"num_experts": "--num-experts", "num_layers": "--num-layers", "top_k": "--top-k"}
"""The :class:`~expertcast.data.importers.common.ImportOptions` fields a layout may require, and their flags."""


@dataclass(frozen=True)
class FormatSpec:
    """The identity, detection and reader of one trace layout.

    Attributes:
        name: ``--format`` name (``vllm``, ``llamacpp``...).
        summary: one line for ``--help``.
        read: ``read(path, opts) -> Imported``: parses and validates everything (ImportFormatError naming
            ``file:line``); ``path`` is a file, or a folder when ``folder_ext`` is set.
        sniff: detection by the file's first JSON value (``sniff(value) -> bool``); None: not a JSON layout.
        csv_headers: detection of a ``.csv`` file by its header (the cells, stripped).
        suffix: detection by the file's suffix alone (e.g. ``.safetensors``).
        folder_ext: extension of the per-sequence files when a folder is accepted (None: one file only).
        files: the files an import of ``path`` reads (hashed into ``source_sha256``); None: ``path`` itself or
            the folder's ``*.folder_ext`` files.
        requires: ``{option field: why}`` of the flags every file of the layout needs (the records do not say
            them); the registry refuses a missing one in one line before ``read`` runs.
        inputs: the option fields the layout reads as input (the others, given, are checked against the file).
    """

    name: str
    summary: str
    read: Callable[[Path, ImportOptions], Imported]
    sniff: Callable[[Any], bool] | None = None
    csv_headers: tuple[tuple[str, ...], ...] = ()
    suffix: str | None = None
    folder_ext: str | None = None
    files: Callable[[Path], list[Path]] | None = None
    requires: Mapping[str, str] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = sorted(set(self.requires) - set(FLAGS)) + sorted(set(self.inputs) - set(FLAGS))
        if bad:
            raise ValueError(f"format spec {self.name}: unknown option field(s) {bad} (known: {sorted(FLAGS)})")
        if self.sniff is None and not self.csv_headers and self.suffix is None:
            raise ValueError(f"format spec {self.name}: no detection (sniff, csv_headers or suffix)")
        if self.folder_ext is not None and self.folder_ext.startswith("."):
            raise ValueError(f"format spec {self.name}: folder_ext is given without its dot")
