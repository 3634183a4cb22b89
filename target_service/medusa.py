"""Medusa heads as a target proposer (Cai et al. 2024, arXiv 2401.10774).

K extra heads read the target's last hidden state h_t (after the final norm, the input
of lm_head). Head i is a ResBlock then a vocabulary projection,

    logits_i = W_i (h + SiLU(A_i h + b_i)),

and predicts token t+i+2: the base lm_head predicts t+1, which is the next step's
committed (recovered or bonus) token, the root of the next tree. The top-k of head i
fill depth i+1 of a token tree whose shape `medusa_choices` fixes: each path [j_1..j_d]
is a node at depth d holding head (d-1)'s j_d-th most likely token, under the node of
path [j_1..j_(d-1)].

Where it runs: in the target service, because the heads need the target's hidden states
(the orchestrator only ever sees token ids). The tree is scored in the step's own
forward pass (`KVSession.forward_segment`) and verified by `sampling.verify_tree`.

Exactness: the candidates come from hidden states of earlier, deterministic forward
passes over the committed history, never from this step's random draws, so verify_tree
keeps the target's law under sampling and the argmax path under greedy. (The reference
implementation's "typical acceptance" is lossy; Tandem does not offer it.)

The heads load and save in the published format (FasterDecoding/Medusa): a directory or
hub repo with `config.json` (medusa_num_heads, medusa_num_layers, base_model_name_or_path)
and `medusa_lm_head.safetensors` or `medusa_lm_head.pt`, a state dict of an
nn.ModuleList of nn.Sequential(ResBlock * layers, Linear(hidden, vocab, bias=False)):
keys `{i}.{j}.linear.weight`, `{i}.{j}.linear.bias`, `{i}.{layers}.weight`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from tandem import sampling
from tandem.kv import KVSession, tree_segment
from tandem.lm import CausalLM
from tandem.models import ModelError
from target_service.candidates import NO_CANDIDATES, Candidates

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

#: A small tree for CPU targets: 14 nodes over 3 heads (the reference's mc_sim_7b_63 has 63
#: nodes over 4 heads, sized for GPUs where a wider pass costs almost nothing).
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
)


class ResBlock(nn.Module):
    """h + SiLU(A h + b): the identity at initialisation (A = 0, b = 0)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.act(self.linear(x))
        return out


class MedusaHeads(nn.Module):
    """K heads; forward(hidden [..., h]) -> logits [K, ..., vocab]."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                 base_model_name_or_path: str = "") -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.base_model_name_or_path = base_model_name_or_path
        # The published key layout: `{i}.{j}.linear.*` for the blocks, `{i}.{num_layers}.weight`.
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)),
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads))

    @classmethod
    def for_model(cls, model: CausalLM, num_heads: int, num_layers: int = 1,
                  base_model_name_or_path: str = "") -> MedusaHeads:
        """New heads for `model`, each projection initialised from its lm_head (as the paper does)."""
        lm_head = model.get_output_embeddings().weight  # [vocab, h]
        heads = cls(num_heads, num_layers, lm_head.shape[1], lm_head.shape[0], base_model_name_or_path)
        with torch.no_grad():
            for projection in heads.projections():
                projection.weight.copy_(lm_head.float())
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.heads])

    def projections(self) -> list[nn.Linear]:
        return [cast(nn.Linear, cast(nn.Sequential, head)[-1]) for head in self.heads]

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def top_k(self, hidden: torch.Tensor, widths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The widths[i] most likely tokens of head i for one hidden row [h]."""
        param = self.projections()[0].weight
        with torch.inference_mode():
            x = hidden.to(device=param.device, dtype=param.dtype)
            return tuple(tuple(torch.topk(head(x).float(), w).indices.tolist())
                         for head, w in zip(self.heads, widths))


# --- The published format -------------------------------------------------------------

def save_heads(heads: MedusaHeads, path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json` and `medusa_lm_head.safetensors` at `path`."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": heads.base_model_name_or_path,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in heads.published_state_dict().items()}
    save_file(tensors, str(out / WEIGHT_FILES[0]), metadata={"format": "pt"})
    return out


def _fetch(ref: str) -> tuple[Path, Path]:
    """(config.json, weights) for a local directory or a hub repo id."""
    local = Path(ref)
    if local.is_dir():
        weights = next((local / f for f in WEIGHT_FILES if (local / f).exists()), None)
        if not (local / CONFIG_FILE).exists() or weights is None:
            raise ModelError(f"Medusa heads directory {ref} needs {CONFIG_FILE} and one of "
                             f"{', '.join(WEIGHT_FILES)}")
        return local / CONFIG_FILE, weights
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        config = Path(hf_hub_download(ref, CONFIG_FILE))
        for name in WEIGHT_FILES:
            try:
                return config, Path(hf_hub_download(ref, name))
            except EntryNotFoundError:  # try the older .pt name
                continue
    except Exception as exc:  # network, auth, a missing repo: one clear message
        raise ModelError(f"cannot fetch Medusa heads {ref!r}: not a local directory, and the hub "
                         f"download failed ({type(exc).__name__}: {exc}); pass a local directory "
                         "(tandem train-medusa writes one)") from exc
    raise ModelError(f"hub repo {ref!r} has neither of {', '.join(WEIGHT_FILES)}")


def load_heads(ref: str) -> MedusaHeads:
    """Heads in the published format from a local directory or a hub repo id (float32, CPU)."""
    config_path, weights_path = _fetch(ref)
    config: dict[str, Any] = json.loads(config_path.read_text())
    if weights_path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights_path))
    else:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        vocab_size, hidden_size = state[f"0.{num_layers}.weight"].shape
    except KeyError as exc:
        raise ModelError(f"Medusa heads {ref}: missing {exc} in {config_path.name} or the weights") from exc
    heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size,
                        str(config.get("base_model_name_or_path", "")))
    # The reference may hold more heads than its config uses (medusa_num_heads overrides).
    wanted = heads.published_state_dict()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ModelError(f"Medusa heads {ref}: the weights lack {missing[:4]}")
    heads.heads.load_state_dict({k: state[k].float() for k in wanted})
    return heads.eval()


# --- The tree -----------------------------------------------------------------------------

@dataclass(frozen=True)
class MedusaTree:
    """The fixed shape of every step's tree, from medusa_choices (paths of top-k indices)."""

    paths: tuple[tuple[int, ...], ...]  # [t] sorted by depth, then index: parents come first
    parents: tuple[int, ...]  # [t] index of each node's parent path; -1 under the root

    @classmethod
    def from_choices(cls, choices: Any) -> MedusaTree:
        paths = sorted({tuple(int(i) for i in p) for p in choices}, key=lambda p: (len(p), p))
        if not paths or any(not p or min(p) < 0 for p in paths):
            raise ValueError("medusa_choices must be a non-empty list of non-empty paths of "
                             "top-k indices >= 0, e.g. [[0], [1], [0, 0]]")
        index = {p: i for i, p in enumerate(paths)}
        orphans = [list(p) for p in paths if len(p) > 1 and p[:-1] not in index]
        if orphans:
            raise ValueError(f"medusa_choices: the parent of each path must be a path too; "
                             f"missing the parents of {orphans[:3]}")
        return cls(tuple(paths), tuple(index.get(p[:-1], -1) for p in paths))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def widths(self) -> tuple[int, ...]:
        """How many top tokens each head must supply: [depth]."""
        return tuple(1 + max(p[-1] for p in self.paths if len(p) == d)
                     for d in range(1, self.depth + 1))

    def token_ids(self, top: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        return tuple(top[len(p) - 1][p[-1]] for p in self.paths)


def parse_choices(text: str) -> MedusaTree:
    """--medusa-choices: a JSON list of paths, or empty for DEFAULT_CHOICES."""
    if not text.strip():
        return MedusaTree.from_choices(DEFAULT_CHOICES)
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--medusa-choices is not JSON: {exc}") from exc
    if not isinstance(choices, list) or not all(isinstance(p, list) for p in choices):
        raise ValueError("--medusa-choices must be a JSON list of lists, e.g. [[0], [1], [0, 0]]")
    return MedusaTree.from_choices(choices)


# --- The proposer --------------------------------------------------------------------------

@dataclass(frozen=True)
class _NextTree:
    """What a step leaves for the next one: the history length it assumes and the heads' top-k."""

    history_length: int
    top: tuple[tuple[int, ...], ...]  # [depth][width]

    def rollback(self, position: int) -> bool:
        return False  # a cut history is no longer the one the heads read


class MedusaProposer:
    """Proposes the Medusa tree from the heads' top-k at the last accepted position."""

    with_hidden = True

    def __init__(self, heads: MedusaHeads, tree: MedusaTree) -> None:
        if tree.depth > heads.num_heads:
            raise ValueError(f"medusa_choices has paths of depth {tree.depth} but the heads are "
                             f"only {heads.num_heads}")
        if max(tree.widths) > heads.vocab_size:
            raise ValueError(f"medusa_choices asks for top-{max(tree.widths)} of a "
                             f"{heads.vocab_size}-token vocabulary")
        self.heads, self.tree = heads, tree
        self.max_segment_tokens = len(tree.paths)

    def get_candidates(self, session: KVSession, new_token_ids: list[int]) -> Candidates:
        state = session.states.get(_NextTree)
        if state is None or state.history_length != session.length + len(new_token_ids):
            # First step, a rebuilt cache, or a history other than the one the heads saw
            # (the orchestrator cut the step short): a plain step, which refills the state.
            return NO_CANDIDATES
        token_ids = self.tree.token_ids(state.top)
        nodes = tuple(range(len(token_ids)))
        return Candidates(tree_segment(token_ids, self.tree.parents), nodes, self.tree.parents)

    def update_candidate_strategy(self, session: KVSession, candidates: Candidates,
                                  logits: torch.Tensor, hidden: torch.Tensor | None,
                                  verdict: sampling.TreeVerdict) -> None:
        assert hidden is not None, "MedusaProposer.with_hidden asks for the hidden states"
        path = verdict.accepted_nodes
        row = 1 + candidates.tree_nodes[path[-1]] if path else 0
        top = self.heads.top_k(hidden[row], self.tree.widths)
        # The next step appends the path and the recovered or bonus token to this history.
        session.states.put(_NextTree(session.length + len(path) + 1, top))


def build_medusa(heads_ref: str, choices: str, model: CausalLM) -> MedusaProposer:
    """The replica's Medusa proposer: heads checked against the target, on its lm_head's device."""
    heads = load_heads(heads_ref)
    lm_head = model.get_output_embeddings().weight
    if (heads.hidden_size, heads.vocab_size) != (lm_head.shape[1], lm_head.shape[0]):
        raise ModelError(
            f"Medusa heads {heads_ref} are for hidden size {heads.hidden_size} and vocabulary "
            f"{heads.vocab_size}; the target has {lm_head.shape[1]} and {lm_head.shape[0]} "
            f"(the heads were trained for {heads.base_model_name_or_path or 'another model'})")
    heads.to(device=lm_head.device, dtype=lm_head.dtype)
    proposer = MedusaProposer(heads, parse_choices(choices))
    log.info("Medusa: %d heads from %s, a %d-node tree of depth %d", heads.num_heads, heads_ref,
             len(proposer.tree.paths), proposer.tree.depth)
    return proposer
