"""A tiny random-weight Hugging Face Llama (safetensors + tokenizer) for vLLM on CPU.

:func:`write_tiny_llama` runs this module with an *engine* venv's python (which has
torch, transformers and tokenizers; the dev venv does not) as
``python -m contract.engines.tiny_hf_model --out DIR``, with ``HF_HUB_OFFLINE=1``.

The model: ``LlamaForCausalLM``, hidden 128, 2 layers, 4 heads of dim 32 (the CPU
attention backend has no head size below 32), 2 KV heads, intermediate 256,
max_position_embeddings 65536, float32, fixed seed. The tokenizer: a byte-level BPE
trained on the spot whose vocabulary holds only printable ASCII, tab and newline (so every
token decodes on its own; other input bytes become ``<unk>``), special tokens ``<unk> <s>
</s> <pad> <|im_start|> <|im_end|>`` (ids 0-5) and a ChatML chat template.

Residual channel 0 is a constant bias channel that no layer reads or writes; the output
rows of the special tokens are -1000 there, so they are never sampled: output is
printable ASCII and, unless ``allow_eos``, never ends before ``max_tokens``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from contract.engines._proc import file_lock
from contract.engines.tiny_gguf import byte_to_unicode

log = logging.getLogger(__name__)

__all__ = ["CHATML_TEMPLATE", "MARKER", "SPECIAL_TOKENS", "write_tiny_llama"]

MARKER = ".canopyx-tiny-llama.json"
_FORMAT = 1
_REPO_ROOT = Path(__file__).resolve().parents[2]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
_EOS_TOKENS = ("</s>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_HIDDEN = 128
_LAYERS = 2
_HEADS = 4
_HEAD_DIM = 32
_KV_HEADS = 2
_INTERMEDIATE = 256
_MAX_POSITIONS = 65536
_VOCAB_TARGET = 320
_BIAS_VALUE = 1.0
_BANNED_LOGIT_WEIGHT = -1000.0

# The BPE merges are learned from this text. ASCII only.
_CORPUS = (
    "The forest canopy is the upper layer of a forest, formed by the crowns of the trees.",
    "It holds most of the leaves, catches most of the light, and shelters a great many",
    "animals that rarely come down to the ground. Rain that falls on the canopy is caught,",
    "held, and slowly released, so the air under the trees stays cool and damp.",
    "Scientists climb into the canopy with ropes, build walkways between the branches,",
    "and count the insects, birds, and plants that live there. In a tall rain forest the",
    "canopy can be thirty to forty metres above the ground; a few emergent trees rise higher.",
    "When an old tree falls, a gap opens in the canopy: light reaches the forest floor, and",
    "young trees race to fill the space. Over many years the gap closes again.",
    'def main(argv): return {"model": "tiny", "max_tokens": 16, "stream": true}  # 1234567890',
    "user: Hello! How are you today?\tassistant: I am fine, thank you. What can I do for you?",
)


def _allowed_bytes() -> list[int]:
    return [0x09, 0x0A, *range(0x20, 0x7F)]


def _params(seed: int, allow_eos: bool) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "seed": seed,
        "allow_eos": allow_eos,
        "hidden": _HIDDEN,
        "layers": _LAYERS,
        "heads": _HEADS,
        "head_dim": _HEAD_DIM,
        "kv_heads": _KV_HEADS,
        "intermediate": _INTERMEDIATE,
        "max_positions": _MAX_POSITIONS,
    }


def _complete(directory: Path, params: dict[str, Any]) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("params") != params:
        return False
    files = marker.get("files") or []
    return bool(files) and all((directory / str(name)).is_file() for name in files)


def write_tiny_llama(
    dir: Path,
    *,
    python: Path,
    seed: int = 0,
    allow_eos: bool = False,
    timeout_s: float = 600.0,
) -> Path:
    """Write the tiny model into ``dir`` with the engine venv's ``python``; return ``dir``.

    Skips the work if ``dir`` already holds a complete model with the same parameters
    (a marker file, written last, records it). The files are built in a sibling temp
    dir and moved in, under a file lock.
    """
    directory = Path(dir).resolve()
    params = _params(seed, allow_eos)
    if _complete(directory, params):
        log.debug("tiny Llama already in %s", directory)
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(directory.parent / f".{directory.name}.lock"):
        if _complete(directory, params):
            return directory
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            env = dict(os.environ)
            env.update(
                PYTHONPATH=str(_REPO_ROOT),
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false",
                PYTHONUNBUFFERED="1",
            )
            argv = [str(python), "-m", "contract.engines.tiny_hf_model"]
            argv += ["--out", str(tmp), "--seed", str(seed)]
            if allow_eos:
                argv.append("--allow-eos")
            log.info("writing tiny Llama to %s with %s", directory, python)
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                check=False,
                env=env,
                cwd=tmp,
                timeout=timeout_s,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"writing the tiny Llama failed with exit code {proc.returncode}:\n"
                    f"{(proc.stdout + proc.stderr)[-4000:]}"
                )
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            directory.mkdir(exist_ok=True)
            (directory / MARKER).unlink(missing_ok=True)
            files = sorted(p.name for p in tmp.iterdir())
            for name in files:
                target = directory / name
                if target.is_dir():
                    shutil.rmtree(target)
                (tmp / name).replace(target)
            marker = {"params": params, "files": files, "summary": summary}
            (directory / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote tiny Llama to %s (%s)", directory, summary)
    return directory


# --------------------------------------------------------------------------- engine side
# Everything below runs in the engine venv (torch, transformers, tokenizers).


def _train_tokenizer() -> Any:
    tk: Any = importlib.import_module("tokenizers")
    alphabet = [byte_to_unicode()[b] for b in _allowed_bytes()]
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS), trainer=trainer)
    allowed = set(alphabet)
    for token, tid in tokenizer.get_vocab().items():
        if token not in SPECIAL_TOKENS and not set(token) <= allowed:
            raise RuntimeError(f"non-ASCII token {token!r} (id {tid}) in the vocabulary")
    for index, name in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(name) != index:
            raise RuntimeError(f"special token {name} is not id {index}")
    return tokenizer


def _build(out: Path, *, seed: int, allow_eos: bool) -> dict[str, Any]:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    raw = _train_tokenizer()
    n_vocab = int(raw.get_vocab_size())
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=_MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out))

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=_HIDDEN,
        intermediate_size=_INTERMEDIATE,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        head_dim=_HEAD_DIM,
        max_position_embeddings=_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    banned = [i for i, name in enumerate(SPECIAL_TOKENS) if not (allow_eos and name in _EOS_TOKENS)]
    with torch.no_grad():
        # Channel 0 carries a constant that only the output layer reads.
        model.model.embed_tokens.weight[:, 0] = _BIAS_VALUE
        for layer in model.model.layers:
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[banned, 0] = _BANNED_LOGIT_WEIGHT
    eos_ids = [SPECIAL_TOKENS.index(name) for name in _EOS_TOKENS]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(out))

    # Self-check: reload, chat-template a prompt and sample a few tokens.
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = loaded.apply_chat_template(
        [{"role": "user", "content": "Hello, tiny model!"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    generator = torch.Generator().manual_seed(seed)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(24):
            logits = model(torch.tensor([seq])).logits[0, -1]
            probs = torch.softmax(logits, dim=-1)
            seq.append(int(torch.multinomial(probs, 1, generator=generator)))
    sampled = seq[len(ids) :]
    if any(t in banned for t in sampled):
        raise RuntimeError(f"a banned token was sampled: {sampled}")
    text = loaded.decode(sampled, skip_special_tokens=True)
    if not text.isascii():
        raise RuntimeError(f"non-ASCII sample {text!r}")
    n_params = sum(int(p.numel()) for p in model.parameters())
    return {
        "vocab_size": n_vocab,
        "parameters": n_params,
        "prompt_tokens": len(ids),
        "sample": text,
        "transformers": str(transformers.__version__),
        "torch": str(torch.__version__),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contract.engines.tiny_hf_model")
    parser.add_argument("--out", required=True, help="directory to write into (must exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-eos", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    summary = _build(Path(args.out), seed=args.seed, allow_eos=args.allow_eos)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
