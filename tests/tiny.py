"""Tiny random targets built in code (no network): a BPE tokenizer trained here with a
ChatML chat template, and 2-4 layer Llama / Qwen2 / Mistral / Gemma models of hidden 32-64
(and GPT-OSS / DeepSeek-V3 / Falcon / GPT-NeoX for the tests of their peculiarities)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from eyas.core.drafter import Eagle3Drafter

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = (
    "the a an of to and in is was for on that with as it by at from this be are or which "
    "model token draft target speculative decoding layer hidden state vocabulary training "
    "python code function return value list number sum answer question explain write story "
    "math two three four five plus minus times equals because therefore first second then "
    "cat dog house river mountain city computer program data loss accuracy step fast slow"
).split()


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        k = int(torch.randint(4, 16, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        lines.append(" ".join(WORDS[i] for i in idx) + (" 12 + 7 = 19." if k % 3 == 0 else "."))
    return lines


def build_tokenizer(vocab_size: int = 256):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(kind: str, vocab: int, hidden: int, layers: int):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "gemma":
        common.update(head_dim=hidden // 4, hidden_activation="gelu_pytorch_tanh")
    # Families with their own attention or names, for the tests that cover them (OTHER_KINDS):
    if kind == "gpt_oss":  # attention sinks kept on the attention modules, sliding layers, MoE
        common.update(head_dim=hidden // 4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if kind == "deepseek_v3":  # MLA: query/key heads 24 wide, value heads 16, as in DeepSeek-V3 (192 / 128)
        common.update(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                      n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                      moe_intermediate_size=32, n_shared_experts=1, num_key_value_heads=4)
    if kind in ("falcon", "gpt_neox"):  # MLP width and embedding under other names
        del common["num_key_value_heads"]
    if kind == "falcon":
        del common["intermediate_size"]
        common.update(new_decoder_architecture=True, num_kv_heads=2, alibi=False, parallel_attn=True, bias=False)
    return AutoConfig.for_model(kind, **common)


def build_target(out: Path, kind: str = "llama", hidden: int = 64, layers: int = 4, seed: int = 0,
                 tokenizer=None) -> Path:
    """Save a tiny random `kind` causal LM + tokenizer to `out` and return it."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer or build_tokenizer()
    torch.manual_seed(seed)
    cfg = _config(kind, len(tok), hidden, layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform logits; a larger head makes greedy
    # decoding and the draft distributions non-trivial.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---------------------------------------------------------------- a trained tiny drafter (doctor, bench, drafter tests)

AUX = [1, 2, 3]  # HF indices, distinct so that +-1 shifts mean other layers
N_DRAFT = 160


def _greedy_corpus(model, tok, n: int = 32, new: int = 20) -> torch.Tensor:
    """The target's greedy continuations of n corpus prefixes (one batched generate)."""
    prefixes = [tok(line)["input_ids"][:5] for line in corpus(4 * n, seed=1)]
    x = torch.tensor([p for p in prefixes if len(p) == 5][:n])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=tok.eos_token_id)  # (n, 5 + new)


def train_tiny_drafter(target_dir: Path, steps: int = 60, seed: int = 0,
                       head_from_target: bool = False) -> tuple[Eagle3Drafter, torch.Tensor]:
    """A drafter trained with the TTT loss on the tiny target's own greedy text (plain loop);
    `head_from_target`: its lm_head starts from the target's rows of the draft ids, as `eyas train`'s."""
    from eyas import targets
    from eyas.core import vocab as core_vocab
    from eyas.core.drafter import DrafterConfig, Eagle3Drafter
    from eyas.core.ttt import target_table, ttt_forward

    torch.manual_seed(seed)
    model, tok = targets.load(target_dir)
    tcfg = targets.load_config(target_dir)
    ids = _greedy_corpus(model, tok)
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    counts = core_vocab.count_tokens(ids, mask, tcfg.vocab_size)
    d2t, t2d = core_vocab.build_from_counts(counts, N_DRAFT)
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, N_DRAFT, AUX))
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    d.load_target_embedding(model.get_input_embeddings().weight)
    if head_from_target:
        with torch.no_grad():
            d.lm_head.weight.copy_(model.lm_head.weight[core_vocab.target_ids(d2t)])
    with torch.no_grad(), targets.capture_aux(model, AUX) as cap:
        model(ids)
        aux, last = cap.aux(), cap.last
    table = target_table(last, mask, model.lm_head.weight, core_vocab.target_ids(d2t), t2d)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=5e-3)
    for _ in range(steps):
        loss, _ = ttt_forward(d, aux, ids, table, steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d, ids
