"""`python -m bench.structured`: structured output on `tandem up`'s stack, side by side in one
run: JSON-schema replies with speculation (the default, auto; and the draft model at k = 4),
without it (k = 0), and HF `generate()` on the target's float32 weights with the same grammar
as a logits processor; and the grammar's mask cost per token (llguidance, and xgrammar where
it is installed).

Each reply is checked: it parses as JSON and has the schema's fields and types. Modes run in
an order that rotates with each repeat, each pass on an orchestrator started afresh (suffix
decoding would otherwise propose a mode's replies from the last mode's); one grammar request
first builds every service's view of the tokenizer (seconds, once per process). Rates are
decode rates (the first token excluded), medians over requests. Results: a markdown table on
stdout and bench/results/structured-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engines import up_stack
from tandem import models
from tandem.grammar import Grammars, GrammarSpec
from tandem.launch import restart
from tandem.v1 import common_pb2

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "email", "languages"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                              "email": {"type": "string"},
                              "languages": {"type": "array", "items": {"type": "string"}}}},
    "tool_call": {"type": "object", "additionalProperties": False, "required": ["tool", "arguments"],
                  "properties": {"tool": {"enum": ["get_weather", "search_web", "send_email"]},
                                 "arguments": {"type": "object", "additionalProperties": False,
                                               "required": ["query", "limit"],
                                               "properties": {"query": {"type": "string"},
                                                              "limit": {"type": "integer"}}}}},
    "inventory": {"type": "object", "additionalProperties": False, "required": ["items"],
                  "properties": {"items": {"type": "array", "items": {
                      "type": "object", "additionalProperties": False, "required": ["sku", "count", "price"],
                      "properties": {"sku": {"type": "string"}, "count": {"type": "integer"},
                                     "price": {"type": "number"}}}}}},
}
ASKS = {
    "person": "Describe a fictional software engineer as JSON with name, age, email and languages.",
    "tool_call": "Find the three best pizza places in Naples: reply with the tool call as JSON.",
    "inventory": "List three items of a small hardware store's stock as JSON: sku, count and price each.",
}
MODES = ("auto", "k4", "k0", "hf")
SPECULATION = {"auto": (None, None), "k4": (4, "draft-model"), "k0": (0, None)}
SAMPLED_SEED = 11


def valid(schema: dict[str, Any], value: Any) -> bool:
    """`value` against the subset of JSON schema above: types, enums, required, no extras."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and all(k in props and valid(props[k], v) for k, v in value.items()))
    if kind == "array":
        return isinstance(value, list) and all(valid(schema["items"], v) for v in value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def tandem_reply(client: Any, ids: list[int], schema: dict[str, Any], mode: str, temperature: float,
                 max_new_tokens: int) -> dict[str, Any]:
    started, first, tokens, summary = time.perf_counter(), None, [], None
    k, proposer = SPECULATION[mode]
    for message in client.generate_stream(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                          seed=SAMPLED_SEED, num_speculative_tokens=k, proposer=proposer,
                                          grammar=common_pb2.Grammar(json_schema=json.dumps(schema))):
        if message.HasField("delta"):
            first = first or (time.perf_counter(), len(message.delta.token_ids))
            tokens.extend(message.delta.token_ids)
        else:
            summary = message.summary
    wall = time.perf_counter() - started
    assert summary is not None and first is not None
    usage = summary.usage
    return {"tokens": tokens, "rate": (len(tokens) - first[1]) / max(1e-9, started + wall - first[0]),
            "finish": summary.finish_reason, "drafted": usage.drafted_tokens, "accepted": usage.accepted_tokens,
            "forced": usage.grammar_forced_tokens, "passes": usage.target_forward_passes}


def hf_reply(model: Any, grammars: Grammars, ids: list[int], schema: dict[str, Any], max_new_tokens: int
             ) -> dict[str, Any]:
    """HF generate(), greedy, float32, with the grammar as a logits processor (each step's
    scores masked to what it allows after the tokens so far)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    state = grammars.state(GrammarSpec("json_schema", json.dumps(schema)), len(ids))
    eos = list(model.generation_config.eos_token_id or [])
    firsts: list[float] = []

    class Masked(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            firsts.append(time.perf_counter())
            state.follow(input_ids[0].tolist())
            allowed = state.allowed()[:scores.shape[-1]]
            return scores.masked_fill(~allowed, -torch.inf)  # type: ignore[return-value]

    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([Masked()]), eos_token_id=eos)
    wall = time.perf_counter() - started
    tokens = out[0, len(ids):].tolist()
    second = firsts[1] if len(firsts) > 1 else started + wall
    return {"tokens": tokens, "rate": (len(tokens) - 1) / max(1e-9, started + wall - second), "finish": 0,
            "drafted": 0, "accepted": 0, "forced": 0, "passes": len(tokens)}


def mask_costs(tokenizer: Any, vocab: int, eos: list[int], replies: dict[str, list[int]]) -> dict[str, float]:
    """Mean µs to compute one mask along the replies' tokens: llguidance (Tandem's), and
    xgrammar where it is installed; and each one's compile time for the schemas, in ms."""
    out: dict[str, float] = {}
    grammars = Grammars(tokenizer, vocab, eos)
    grammars.warm()
    times, compiles = [], []
    for name, tokens in replies.items():
        started = time.perf_counter()
        state = grammars.state(GrammarSpec("json_schema", json.dumps(SCHEMAS[name])), 0)
        compiles.append((time.perf_counter() - started) * 1000.0)
        for token in tokens:
            started = time.perf_counter()
            state.allowed()
            times.append((time.perf_counter() - started) * 1e6)
            state.take(token)
    out["llguidance_mask_us"], out["llguidance_compile_ms"] = statistics.mean(times), statistics.median(compiles)
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times, compiles = [], []
    for name, tokens in replies.items():
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMAS[name]), any_whitespace=False,
                                                                  separators=(", ", ": ")))
        compiles.append((time.perf_counter() - started) * 1000.0)
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append((time.perf_counter() - started) * 1e6)
            if not matcher.accept_token(token):
                break
    out["xgrammar_mask_us"], out["xgrammar_compile_ms"] = statistics.mean(times), statistics.median(compiles)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    prompts = {name: list(tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                                        add_generation_prompt=True, return_dict=False))
               for name, ask in ASKS.items()}
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    sampled: list[dict[str, Any]] = []
    stack = up_stack()
    try:
        with stack.client() as client:  # every service's view of the tokenizer, built once
            client.generate(prompts["person"], max_new_tokens=8, num_speculative_tokens=2, proposer="draft-model",
                            grammar=common_pb2.Grammar(json_object=True))
        for rep in range(args.repeats):
            shift = rep % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                if mode == "hf":
                    continue  # after the stack, alone on the cores
                stack.orchestrator.stop()  # a fresh orchestrator: no suffix index of other modes' replies
                stack.orchestrator = restart(stack.orchestrator)
                with stack.client() as client:
                    for name, ids in prompts.items():
                        reply = tandem_reply(client, ids, SCHEMAS[name], mode, 0.0, args.max_new_tokens)
                        results[mode].append({"schema": name, **reply})
        with stack.client() as client:
            for name, ids in prompts.items():  # sampled, with speculation
                sampled.append({"schema": name, **tandem_reply(client, ids, SCHEMAS[name], "auto", 0.8,
                                                               args.max_new_tokens)})
    finally:
        stack.stop()
    if "hf" in modes:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(models.resolve(models.DEFAULT_TARGET),
                                                     dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
        grammars = Grammars(tokenizer, model.config.vocab_size, list(model.generation_config.eos_token_id or []))
        for name, ids in prompts.items():  # one pass: float32 generate() is deterministic and slow
            results["hf"].append({"schema": name, **hf_reply(model, grammars, ids, SCHEMAS[name],
                                                              args.max_new_tokens)})
    texts = {m: [(r["schema"], tokenizer.decode(r["tokens"], skip_special_tokens=True)) for r in results[m]]
             for m in modes}
    checks = {m: [valid(SCHEMAS[s], json.loads(t)) if _parses(t) else False for s, t in texts[m]] for m in modes}
    first = results[modes[0]][0]
    costs = mask_costs(tokenizer, 151936, [151645, 151643],
                       {r["schema"]: r["tokens"] for r in results[modes[0]][:len(SCHEMAS)]})
    lines = ["| mode | tokens/s (median) | valid replies | drafted / accepted (forced) | target passes |",
             "|---|---|---|---|---|"]
    for m in modes:
        rs = results[m]
        lines.append(f"| {m} | {statistics.median(r['rate'] for r in rs):.2f} | {sum(checks[m])}/{len(rs)} | "
                     f"{sum(r['drafted'] for r in rs)} / {sum(r['accepted'] for r in rs)} "
                     f"({sum(r['forced'] for r in rs)}) | {sum(r['passes'] for r in rs)} |")
    sampled_ok = sum(_parses(t := tokenizer.decode(r["tokens"], skip_special_tokens=True))
                     and valid(SCHEMAS[r["schema"]], json.loads(t)) for r in sampled)
    lines.append(f"\nsampled (T 0.8, auto): {sampled_ok}/{len(sampled)} valid; "
                 f"mask cost per token: {json.dumps({k: round(v, 1) for k, v in costs.items()})}")
    same = all(r["tokens"] == results[modes[0]][i % len(SCHEMAS)]["tokens"]
               for m in modes for i, r in enumerate(results[m]))
    lines.append(f"greedy replies: {'the same in every mode' if same else 'DIFFERENT between modes'}")
    print("\n".join(lines))
    print("\n".join(f"{s}: {t}" for s, t in texts[modes[0]]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(
        {"argv": argv, "results": results, "sampled": sampled, "mask_costs": costs, "first": first["schema"]},
        indent=1))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    main()
