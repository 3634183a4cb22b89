"""The machinery on a GPU, in minutes: a random model of the real target's shape serves as
both draft and target (the draft proposes what the target would: every token accepted but
for rounding), through the real services, against HF `generate()` in process.

Prints HF's tokens/s, Tandem's at k=0 and k=4, and where a step's time goes (each replica's
pass by stage, the bytes it reads to the host, the orchestrator's own time, the wire's).
`--device cpu --shape tiny` runs the same path on a CPU in seconds (CI's smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import tiny
from bench.run import machinery
from tandem.launch import start_stack

# Qwen2.5-1.5B's shape (the built-in target), and a tiny one for the CPU smoke test.
SHAPES: dict[str, dict[str, Any]] = {
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151_936},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151_936},
}


def make_model(path: Path, shape: str, dtype: torch.dtype, device: str) -> Path:
    """A random Qwen2 model of `shape`, initialised on `device` (fast on a GPU), saved at `path`
    with the tests' character tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=0, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0)  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    tiny.make_tokenizer().save_pretrained(path)
    del model
    return path


def hf_tokens_per_s(path: Path, prompt: list[int], tokens: int, dtype: torch.dtype, device: str,
                    repeats: int) -> tuple[float, list[int]]:
    """HF generate()'s greedy tokens/s (median), and its tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,  # type: ignore[no-untyped-call]
                              eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], device=device)
    rates, out = [], None
    with torch.inference_mode():
        model.generate(ids, generation_config=GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0))  # warm-up
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = model.generate(ids, generation_config=config)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            rates.append(tokens / (time.perf_counter() - started))
    assert out is not None
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(rates), out[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--decode-graph", default="auto",
                        help="the target's --decode-graph (auto: a decode run's one-token passes "
                             "captured as a CUDA graph on cuda; off: uncaptured)")
    parser.add_argument("--out", default="", help="write the figures as JSON here too")
    parser.add_argument("--logs", default="", help="keep the services' logs in this directory")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="tandem-gpu-check-"))
    path = make_model(root / "model", args.shape, dtype, args.device)
    print(f"model: a random {args.shape}-shaped Qwen2 in {args.dtype} on {args.device} "
          f"({time.perf_counter() - started:.0f}s to make)", flush=True)
    prompt = [2 + (i * 7) % 30 for i in range(args.prompt_tokens)]
    hf_rate, hf_tokens = hf_tokens_per_s(path, prompt, args.tokens, dtype, args.device, args.repeats)
    print(f"HF generate(): {hf_rate:.1f} tokens/s", flush=True)

    service = ["--device", args.device, "--dtype", args.dtype]
    logs = Path(args.logs) if args.logs else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    stack = start_stack(str(path), str(path), draft_dtype=args.dtype, target_dtype=args.dtype,
                        draft_args=service, target_args=[*service, "--decode-graph", args.decode_graph],
                        log_dir=logs)
    results: dict[str, Any] = {"device": args.device, "shape": args.shape, "dtype": args.dtype,
                               "decode_graph": args.decode_graph,
                               "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                               "hf_tokens_per_s": hf_rate}
    try:
        client = stack.client()
        client.generate(prompt, max_new_tokens=8, num_speculative_tokens=args.k, ignore_eos=True)  # warm-up
        runs: dict[int, list[tuple[float, Any, list[int]]]] = {0: [], args.k: []}
        for _ in range(args.repeats):
            for k, done in runs.items():  # interleaved: drift hits both alike
                began = time.perf_counter()
                reply = client.generate(prompt, max_new_tokens=args.tokens, num_speculative_tokens=k,
                                        ignore_eos=True)
                done.append((args.tokens / (time.perf_counter() - began), reply.usage,
                             list(reply.token_ids)))
    finally:
        stack.stop()
    for k, done in runs.items():
        rate = statistics.median(r for r, _, _ in done)
        usage = done[len(done) // 2][1]
        tested = usage.accepted_tokens + usage.rejected_tokens
        split = machinery(usage)
        results[f"k{k}"] = {"tokens_per_s": rate, "x_hf": rate / hf_rate,
                            "drafted_tokens": usage.drafted_tokens,
                            "alpha": usage.accepted_tokens / tested if tested else None,
                            "equal_to_hf": next((i for i, (t, h) in enumerate(zip(done[0][2], hf_tokens,
                                                                                 strict=False)) if t != h),
                                                min(len(done[0][2]), len(hf_tokens))),
                            "machinery": split}
        line = (f"Tandem k={k}: {rate:.1f} tokens/s = {rate / hf_rate:.2f}x HF, "
                f"{usage.drafted_tokens} tokens drafted"
                + (f", alpha {usage.accepted_tokens / tested:.2f}" if tested else "")
                + f"; first {results[f'k{k}']['equal_to_hf']} of {args.tokens} tokens equal to HF's")
        print(line)
        print("  per step: orchestrator {orchestrator_ms:.2f} ms, wire {wire_ms:.2f} ms; target pass: "
              "before {target_before_ms:.2f} / forward {target_forward_ms:.2f} / after "
              "{target_after_ms:.2f} ms, {target_host_bytes:.0f} bytes to the host, "
              "{target_captured_share:.0%} of passes captured".format(**split)
              + ("; draft pass: before {draft_before_ms:.2f} / forward {draft_forward_ms:.2f} / "
                 "after {draft_after_ms:.2f} ms, {draft_host_bytes:.0f} bytes".format(**split)
                 if "draft_before_ms" in split else ""), flush=True)
    results[f"k{args.k}_x_k0"] = results[f"k{args.k}"]["tokens_per_s"] / results["k0"]["tokens_per_s"]
    print(f"k={args.k} / k=0: {results[f'k{args.k}_x_k0']:.2f}x; whole check "
          f"{time.perf_counter() - started:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
