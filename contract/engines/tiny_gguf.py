"""A tiny random-weight llama GGUF that llama.cpp loads and that generates printable ASCII.

Architecture llama: n_embd 64, 2 layers, 4 heads, 2 KV heads, n_ff 128, all F32. A gpt2-style
byte-level tokenizer with every byte, merges learned at run time from a built-in paragraph,
and ChatML control tokens. A constant "bias channel" on residual dimension 0 pins the logits of
banned tokens (special tokens unless allowed, non-ASCII and control bytes) at -1000, so output
always runs to ``max_tokens`` and every token decodes. With ``ends_sentences`` (the demo's model)
a second constant channel marks the tokens that end a sentence, and the end-of-sequence token
follows each of them: answers end by themselves after their first full stop.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["byte_to_unicode", "write_tiny_gguf"]

log = logging.getLogger(__name__)

# Merges are learned from this text at run time, so the vocabulary has real multi-byte
# tokens without shipping a tokenizer file. ASCII only: every merged token is printable.
_PARAGRAPH = (
    "The forest canopy is the upper layer of a forest, formed by the crowns of the trees. "
    "It holds most of the leaves, catches most of the light, and shelters a great many "
    "animals that rarely come down to the ground. Rain that falls on the canopy is caught, "
    "held, and slowly released, so the air under the trees stays cool and damp. Scientists "
    "climb into the canopy with ropes, build walkways between the branches, and count the "
    "insects, birds, and plants that live there. In a tall rain forest the canopy can be "
    "thirty to forty metres above the ground, and a few emergent trees rise even higher. "
    "When an old tree falls, a gap opens in the canopy; light reaches the forest floor, "
    "and young trees race to fill the space. Over many years the gap closes again, and the "
    "forest keeps its shape while every tree in it changes. 1234567890 + 42 = 1276."
)
_N_MERGES = 200
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: What ends a sentence (each is a token of its own: no merge joins them to another byte).
_SENTENCE_ENDS = b".!?"
#: How much the bias channel favours a sentence's end over the other tokens. Measured on
#: llama-server b10798 with its default sampler, seed 0, 400 chat answers: 7.5 tokens on average
#: (the end token included), 14 at the 90th percentile, 30 the longest.
_END_BIAS = 0.5
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to one printable unicode character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(text: str, n_merges: int, alphabet: dict[int, str]) -> list[tuple[str, str]]:
    """Greedy byte-pair merges over GPT-2-style pre-split words (deterministic ties)."""
    import re

    words: dict[tuple[str, ...], int] = {}
    for piece in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text):
        key = tuple(alphabet[b] for b in piece.encode())
        words[key] = words.get(key, 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        new_words: dict[tuple[str, ...], int] = {}
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            key = tuple(out)
            new_words[key] = new_words.get(key, 0) + count
        words = new_words
    return merges


def _banned_byte(b: int) -> bool:
    """Bytes the model may never emit: non-ASCII (invalid UTF-8 alone) and control bytes."""
    if b in (0x09, 0x0A):
        return False
    return b < 0x20 or b >= 0x7F


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    context_length: int = 4096,
    allow_eos: bool = False,
    ends_sentences: bool = False,
    size: tuple[int, int, int] = (64, 2, 128),
) -> Path:
    """Write a tiny random llama GGUF (F32, about 0.5 MB) that llama-server loads.

    ``size`` is (n_embd, layers, n_ff): 64, 2, 128 by default; a larger one makes a model whose
    prefill costs measurable time (the prefix-routing benchmark's: 256, 6, 1024, about 10 MB).
    4 heads, 2 KV heads; GPT-2 byte-level BPE vocabulary
    (256 bytes + merges + ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``) and a ChatML
    template. Residual dim 0 is a constant bias channel; output rows of banned tokens
    are -1000 there, so they are never sampled: output is printable ASCII (plus tab and
    newline), and unless ``allow_eos`` it never ends before ``max_tokens``. With
    ``ends_sentences`` it ends its answer after the first ``.``, ``!`` or ``?`` it writes (the
    end-of-sequence token then always follows), and it writes one often enough that an answer
    rarely runs past a few dozen tokens (residual dim 1 marks those tokens, as dim 0 is the bias).
    The same arguments give a byte-identical file.
    """
    import gguf
    import numpy as np

    (n_embd, n_layer, n_ff), n_head, n_head_kv = size, 4, 2
    head_dim = n_embd // n_head
    bias_value = 4.0

    alphabet = byte_to_unicode()
    tokens: list[str] = [alphabet[b] for b in range(256)]
    types: list[int] = [_TOKEN_NORMAL] * 256
    merges = _learn_merges(_PARAGRAPH, _N_MERGES, alphabet)
    known = set(tokens)
    for left, right in merges:
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
            types.append(_TOKEN_NORMAL)
    special_ids: dict[str, int] = {}
    for name in _SPECIAL_TOKENS:
        special_ids[name] = len(tokens)
        tokens.append(name)
        types.append(_TOKEN_CONTROL)
    n_vocab = len(tokens)

    banned = [b for b in range(256) if _banned_byte(b)]
    may_end = allow_eos or ends_sentences
    banned += [tid for name, tid in special_ids.items() if not (may_end and name == "<|im_end|>")]
    ends = list(_SENTENCE_ENDS)  # a byte's token ID is the byte

    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors: list[tuple[str, Any]] = []
    embd = rand(n_vocab, n_embd, scale=0.5)
    embd[:, 0] = bias_value
    if ends_sentences:  # dim 1: the token just read ends a sentence; dim 2: it is a newline
        embd[:, 1:3] = 0.0
        embd[ends, 1] = bias_value
        embd[ord("\n"), 2] = bias_value
    tensors.append(("token_embd.weight", embd))
    s_embd = 1 / np.sqrt(n_embd)
    for i in range(n_layer):
        wo = rand(n_embd, n_head * head_dim, scale=0.3 / np.sqrt(n_embd))
        wo[0, :] = 0.0  # nothing writes to the bias channel
        down = rand(n_embd, n_ff, scale=0.3 / np.sqrt(n_ff))
        down[0, :] = 0.0
        if ends_sentences:  # nor to the sentence-end and newline channels
            wo[1:3, :] = 0.0
            down[1:3, :] = 0.0
        tensors += [
            (f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32)),
            (f"blk.{i}.attn_q.weight", rand(n_head * head_dim, n_embd, scale=s_embd)),
            (
                f"blk.{i}.attn_k.weight",
                rand(n_head_kv * head_dim, n_embd, scale=s_embd),
            ),
            (
                f"blk.{i}.attn_v.weight",
                rand(n_head_kv * head_dim, n_embd, scale=s_embd),
            ),
            (f"blk.{i}.attn_output.weight", wo),
            (f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32)),
            (f"blk.{i}.ffn_gate.weight", rand(n_ff, n_embd, scale=s_embd)),
            (f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd, scale=s_embd)),
            (f"blk.{i}.ffn_down.weight", down),
        ]
    tensors.append(("output_norm.weight", np.ones(n_embd, dtype=np.float32)))
    out = rand(n_vocab, n_embd, scale=0.3)
    out[:, 0] = 0.0
    out[banned, :] = 0.0
    out[banned, 0] = -1000.0
    if ends_sentences:
        eos = special_ids["<|im_end|>"]
        out[:, 1:3] = 0.0
        out[ends, 0] = _END_BIAS
        out[ends, 2] = -1000.0  # never right after a newline: an answer is never only "."
        out[eos, :] = 0.0
        out[eos, 0] = -1000.0  # never, unless ...
        out[eos, 1] = 2000.0  # ... the token just read ended a sentence: then always
    tensors.append(("output.weight", out))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    writer.add_name(f"canopyx-tiny-s{seed}")
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # ALL_F32
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(special_ids["<|endoftext|>"])
    writer.add_pad_token_id(special_ids["<|endoftext|>"])
    writer.add_eos_token_id(special_ids["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(_CHATML_TEMPLATE)
    for name, data in tensors:
        writer.add_tensor(name, data)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(path)
    log.debug("wrote %s (vocab %d, seed %d)", path, n_vocab, seed)
    return path
