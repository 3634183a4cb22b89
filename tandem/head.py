"""A target's output projection on a CPU, read for a greedy pass one slice of the vocabulary
at a time, so that each row's argmax is found without holding the row.

A greedy step needs one id per kept row: the target's argmax. Projecting the rows onto the
whole vocabulary first writes a [rows, vocab] float tensor and then reads it all back to
find the maxima. For a few rows that tensor sits in cache and costs little; for many (16
sessions scoring 5 rows each over a 152k vocabulary: 49 MB) it is allocated afresh every
pass, past the size the C allocator keeps for reuse, so its pages fault in each time, and it
is read back from memory. `VocabChunks.argmax` projects onto consecutive slices of the head's
rows (views of its weight) and keeps a running maximum; a slice holds `slice_bytes` of
logits whatever the row count (a pass of one row: the whole vocabulary in one slice, the
plain product), so each slice's logits are read while still in cache and nothing
vocabulary-wide is allocated. The model's head and logits are unchanged; passes that read
probabilities use them as before.

Only where the model's logits are exactly its head applied to its decoder's last hidden
states (no softcapping or scaling after it), and the head is a plain `nn.Linear` (not packed
by oneDNN: tandem.matmul): `install` checks both on the model itself. The ids are the
head's own argmax up to float rounding of the slices' products, the caveat every CPU matmul
path already carries (tandem.matmul).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from tandem import sampling
from tandem.lm import CausalLM

log = logging.getLogger(__name__)

#: Logits per slice: about a core's L2 cache.
SLICE_BYTES = 1 << 20


class VocabChunks:
    """The argmax of an `nn.Linear` output projection [vocab, hidden], slice by slice."""

    def __init__(self, head: nn.Linear, slice_bytes: int = SLICE_BYTES) -> None:
        self.head, self.slice_bytes = head, slice_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The whole head's logits, for the passes that read probabilities."""
        return self.head(x)  # type: ignore[no-any-return]

    def slices(self, rows: int) -> list[int]:
        """Where each slice starts, for a pass of `rows` rows."""
        vocab = self.head.out_features
        width = max(1, self.slice_bytes // (rows * self.head.weight.element_size()))
        return list(range(0, vocab, width)) if width < vocab else [0]

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).argmax(-1)` for hidden states x [n, hidden] -> ids [n]: the lowest id among
        ties (a later slice wins only with a strictly larger value), a NaN as torch's argmax
        takes it (the first NaN)."""
        weight, bias, vocab = self.head.weight, self.head.bias, self.head.out_features
        starts = self.slices(x.shape[0])
        if len(starts) == 1:
            return sampling.argmax(self.head(x))
        ids, values = [], []
        for start, end in zip(starts, [*starts[1:], vocab], strict=True):
            logits = F.linear(x, weight[start:end], None if bias is None else bias[start:end])
            best = sampling.argmax(logits)  # [n]
            ids.append(best + start)
            values.append(logits.gather(-1, best[:, None]))
        # torch's argmax over the slices' maxima: the first slice among equals, a NaN first
        which = torch.cat(values, -1).argmax(-1, keepdim=True)
        return torch.stack(ids, -1).gather(-1, which)[:, 0]


def refusal(model: CausalLM) -> str | None:
    """Why the model's head cannot be read in slices (None: it can)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"its output projection is a {type(head).__name__}, not a plain Linear"
    if head.weight.device.type != "cpu":
        return "it is not on a CPU (a GPU reads the argmax where the logits are)"
    return None


@torch.inference_mode()
def install(model: CausalLM, slice_bytes: int = SLICE_BYTES) -> VocabChunks | None:
    """The model's head read in slices, where that reproduces the model's own logits and
    argmax on a probe; None (logged why) where it does not. The model is left as it is."""
    why_not = refusal(model)
    if why_not is None:
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.tensor([[i % vocab for i in range(1, 9)]], device=model.get_output_embeddings().weight.device)
        want = model(input_ids=ids).logits[0]
        chunks = VocabChunks(model.get_output_embeddings(), slice_bytes)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        got = chunks(hidden)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            why_not = "its logits are not its head's product of the decoder's states (softcapped or scaled?)"
        elif not torch.equal(chunks.argmax(hidden), want.argmax(-1)):
            why_not = "the sliced argmax did not reproduce the logits' argmax on a probe"
    if why_not is not None:
        log.info("vocabulary head: whole (%s)", why_not)
        return None
    log.info("vocabulary head: greedy passes read their argmax in slices of %d KiB of logits",
             slice_bytes >> 10)
    return chunks
