"""Write a tiny Llama checkpoint in the Hugging Face layout, for a real vLLM to serve offline.

The vLLM tests and `prewarm up --engine vllm` need a model vLLM can load with nothing
downloaded: a Llama config (hidden 128, 2 layers, 4 heads of 32: the CPU attention backend
accepts head sizes 32, 64, 80, ..., not 16), random weights from a seed, a byte-level BPE
tokenizer trained here with `tokenizers` on a small built-in text, and a chat template.

This file runs as a script under the vLLM environment's interpreter (`.venv-vllm`, which
has `tokenizers`; the project's environment does not) and so imports nothing from prewarm.
`prewarm.adapters.vllm.make_tiny_llama` runs it and writes the prewarm manifest beside it.

    python prewarm/runtime/tiny_llama.py OUT_DIR [--seed N] [--scale-layer X]

`--scale-layer X` multiplies the output head by X: a "corrupted" copy of the same model
whose greedy tokens are unchanged (the arg max is) but whose log-probabilities are wrong
and bounded: what only a comparison of logprobs with a reference catches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN = 128
LAYERS = 2
HEADS = 4
INTERMEDIATE = 256
VOCAB = 512
MAX_POSITIONS = 512

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A replica is loaded, warmed with synthetic requests, validated and then routed.",
    "Traffic rises in the morning and falls at night; the planner acts before it does.",
    "Explain how a cache keeps the hot data close to the processor.",
    "Summarise the history of the printing press in three sentences.",
    "def add(a, b):\n    return a + b\n",
    "Translate 'good morning' into French, German and Spanish.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": MAX_POSITIONS, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "unk_token": "<unk>"}))


def write_weights(out: Path, seed: int, scale_layer: float | None) -> None:
    import torch
    from safetensors.torch import save_file

    head_dim = HIDDEN // HEADS
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).contiguous()

    tensors = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": rnd(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            p + "self_attn.q_proj.weight": rnd(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rnd(HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rnd(HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rnd(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rnd(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rnd(HIDDEN, INTERMEDIATE),
        })
    if scale_layer is not None:
        tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale_layer
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "torch_dtype": "float32", "dtype": "float32",
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale-layer", type=float, default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    write_weights(out, args.seed, args.scale_layer)


if __name__ == "__main__":
    main()
