"""What each serving engine reads from a drafter directory, and conversion between layouts.

spec.py holds one named spec per engine and layout (`spec(name)`): key prefixes, the aux-id
convention, the config view and flags, what the loader reads, ignores and refuses, and how a
checkpoint for it is written, with the loader sources it was read from. The rest asks it:

- configs.py: config.json dicts (the flat Llama fields, speculators' nesting), read and written.
- reading.py: `detect_layout(dir)`; `engine_reading(dir, engine)`, what that engine would really
  load and run (lenient: it records what the engine would silently skip or leave random).
- importing.py: `import_checkpoint(dir)`, any layout -> (DrafterConfig, state in eyas names, meta),
  strict: missing keys, shape or config/weight contradictions and bad vocab maps raise EyasError.
- writing.py: `write_layout(cfg, state, fmt, out)` / `export_checkpoint(eyas_dir, fmt, out)`.
- checks.py: `static_check(dir, engine)`, the problems in a reading that make it load broken.
"""

from eyas.formats.engines.checks import (SHARED_FIELDS, SIZE_FIELDS, config_differences, max_aux_id,
                                         reading_summary, static_check)
from eyas.formats.engines.configs import FLAGS, SPECULATORS_VERSION
from eyas.formats.engines.importing import import_checkpoint, native_config
from eyas.formats.engines.reading import (EngineReading, detect_layout, engine_reading, expected_shapes,
                                          read_dir, to_eyas_names)
from eyas.formats.engines.spec import (ENGINES, EYAS, FAMILY, LAYER_KEYS, LAYOUTS, RUNTIME_ENGINES, SERVING, SPECS,
                                       EngineSpec, native_engines, spec)
from eyas.formats.engines.writing import engine_config, export_checkpoint, needs_embedding, write_layout
from eyas.formats.target_weights import EMBED_NAMES, target_embedding

__all__ = ["SHARED_FIELDS", "SIZE_FIELDS", "config_differences", "max_aux_id", "reading_summary", "static_check",
           "FLAGS", "SPECULATORS_VERSION", "import_checkpoint", "native_config", "EngineReading", "detect_layout",
           "engine_reading", "expected_shapes", "read_dir", "to_eyas_names", "ENGINES", "EYAS", "FAMILY",
           "LAYER_KEYS", "LAYOUTS", "RUNTIME_ENGINES", "SERVING", "SPECS", "EngineSpec", "native_engines", "spec",
           "EMBED_NAMES", "engine_config", "export_checkpoint", "needs_embedding", "target_embedding",
           "write_layout"]
