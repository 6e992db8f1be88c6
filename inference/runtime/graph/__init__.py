"""The graph decode path: the same policies as the eager driver, compiled (docs/design.md, "Graph-compatible decode path").

Modules by job: :mod:`.path` (which decode path runs: :func:`~.path.device_program_of` decides support),
:mod:`.state` (the device residency tables), :mod:`.decode` (the per-layer device step and its host sync),
:mod:`.copier` (miss copies on the device; :mod:`.triton` on CUDA), :mod:`.planner` (forecasts on the background
forecaster), :mod:`.aot` (AOTInductor-compiled layer, CPU), :mod:`.cuda_graph` (CUDA Graph capture and replay).
"""

from expertcast.inference.runtime.graph.decode import COMPILE_BACKENDS, MAX_BATCH, GraphDecoder
from expertcast.inference.runtime.graph.path import DECODE_PATHS, choose_decode_path, device_program_of

__all__ = ["COMPILE_BACKENDS", "DECODE_PATHS", "MAX_BATCH", "GraphDecoder", "choose_decode_path",
           "device_program_of"]
