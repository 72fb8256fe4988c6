"""The decoding runtime: wires a target model, a drafter and their KV caches into the pure
functions of `eyas.core.speculative`, times every forward, and emulates how a serving engine
(SGLang, vLLM) would run a given checkpoint (`--engine`).

- `kv`: the preallocated KV cache; `runners`: target and drafter forwards as the loop drives them;
- `decode`: plain, chain and tree decoding (`generate`), and teacher-forced drafter accuracy;
- `loading`: a drafter checkpoint loaded as eyas runs it or as an engine would;
- `batched` and `regenerate`: regeneration, the target writing the assistant turns of many
  conversations in batches (imported by module, not re-exported below).

Methods: `plain` (target alone, one token per forward), `chain` (k drafts), `tree` (EAGLE-2
dynamic tree). Greedy output of chain/tree is the target's own greedy output; with temperature
> 0 they sample losslessly (core/speculative.py). The names below are the package's interface.
"""

from eyas.runtime.decode import (METHODS, DecodeResult, DecodeSettings, generate, generate_plain,
                                 generate_speculative, teacher_forced)
from eyas.runtime.kv import KVPool, PreallocLayer
from eyas.runtime.loading import ENGINES, LoadedDrafter, drafter_from_reading, load_drafter
from eyas.runtime.runners import DrafterRunner, TargetRunner, Timer, runners

__all__ = ["METHODS", "DecodeResult", "DecodeSettings", "generate", "generate_plain", "generate_speculative",
           "teacher_forced", "KVPool", "PreallocLayer", "ENGINES", "LoadedDrafter", "drafter_from_reading",
           "load_drafter", "DrafterRunner", "TargetRunner", "Timer", "runners"]
