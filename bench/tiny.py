"""Tiny random Hugging Face models with a real (character-level) tokenizer, saved to disk:
the models of the tests and of `tandem bench-load`.

They load through the same `from_pretrained(path)` code as real models, so the tests
exercise the real loading path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tandem import matmul

EOS = "<eos>"
PROMPTS = ["def fib(n):", "hello world", "x = (a, b)\n", "a"]
DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n"


def make_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")  # type: ignore[no-untyped-call]


def make_model(path: Path, *, seed: int, chars: str = DEFAULT_CHARS, eos_token_id: int = 0,
               layers: int = 2, hidden: int = 32, init_std: float = 0.3,
               vocab_size: int | None = None, attention_bias: bool = False) -> Path:
    """Save a tiny random Llama model and its tokenizer at `path` (`attention_bias`: its
    attention projections carry biases, as Qwen2's do)."""
    tokenizer = make_tokenizer(chars)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=init_std, tie_word_embeddings=False,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
        attention_bias=attention_bias,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    if attention_bias:  # transformers starts biases at zero, where losing one would show nowhere
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, init_std)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_draft_like(target: Path, path: Path, *, noise: float, seed: int) -> Path:
    """A draft that is the target plus Gaussian weight noise: partial agreement with the target.

    noise=0 gives a draft identical to the target (every drafted token accepted).
    """
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).exists():
            (path / name).write_bytes((target / name).read_bytes())
    return path


def greedy_reference(path: Path | str, prompt_ids: list[int], max_new_tokens: int,
                     eos_token_id: int | None = None, matmul_path: str = matmul.DEFAULT
                     ) -> list[int]:
    """The target's own greedy generate() on a matmul path: the ground truth for exactness tests."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    matmul.apply(model, matmul_path, matmul.TIMED_ROWS)
    # generate() falls back to the model's own EOS for an unset one: clear it to ignore EOS.
    model.generation_config.eos_token_id = eos_token_id
    model.config.eos_token_id = eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,  # type: ignore[no-untyped-call]
                              eos_token_id=eos_token_id, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return [int(t) for t in out[0, len(prompt_ids):]]


def make_pair(directory: Path) -> tuple[Path, Path]:
    """(draft, target): the tests' tiny pair, a target and a noisy copy of it as the draft."""
    target = make_model(directory / "target", seed=1)
    return make_draft_like(target, directory / "draft", noise=0.05, seed=2), target


def _byte_level(text: str) -> str:
    """A token's text in GPT-2's byte-level alphabet (space -> U+0120, newline -> U+010A, ...),
    the form llama.cpp's BPE vocabularies hold."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return "".join(mapping[b] for b in text.encode())


def make_gguf(hf_dir: Path, out_dir: Path) -> Path:
    """The tiny Llama model at `hf_dir` as a float32 GGUF file in `out_dir`, beside a copy of its
    tokenizer files (what a llama.cpp draft service loads); its path."""
    import gguf
    import numpy as np

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config: Any = model.config  # a LlamaConfig: every field below is set
    tokenizer = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "draft.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([_byte_level(token) for token, _ in vocab])
    special = set(tokenizer.all_special_tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges(["a b"])  # llama.cpp's BPE vocabularies must hold merges
    writer.add_eos_token_id(int(config.eos_token_id))

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        # HF rotates the two halves of a head; llama.cpp's llama rotates adjacent pairs.
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for name, key in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                          ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                          ("ffn_down", "mlp.down_proj")):
            writer.add_tensor(f"blk.{i}.{name}.weight", state[layer + key + ".weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(state[layer + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight",
                          permute(state[layer + "self_attn.k_proj.weight"], kv_heads))
        for part, name, rotated in (("q", "attn_q", heads), ("k", "attn_k", kv_heads),
                                    ("v", "attn_v", 0), ("o", "attn_output", 0)):
            bias = state.get(f"{layer}self_attn.{part}_proj.bias")
            if bias is not None:  # the rotated projections' biases are laid out as their rows
                writer.add_tensor(f"blk.{i}.{name}.bias", permute(bias, rotated) if rotated else bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (hf_dir / name).exists():
            (out_dir / name).write_bytes((hf_dir / name).read_bytes())
    return path
