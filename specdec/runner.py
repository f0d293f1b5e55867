"""The model runner: owns the KV tensors and turns a scheduled step into one forward pass.

KV memory is allocated once, ``[num_blocks, block_size, kv_heads, head_dim]`` per layer for keys
and for values, and each attention layer gets a view. Block ids come from the scheduler's block
manager; the runner only indexes with them. Each step it flattens the batch (prefill chunks,
decodes and drafts alike) into one token stream and computes logits only where a token is sampled
or verified.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
from dataclasses import dataclass, field

import torch

from specdec.attention import AttentionMetadata
from specdec.cuda_graphs import CaptureError, StepGraphs
from specdec.models.layer_outputs import AttentionProbe, forward_with_layers
from specdec.models.llama import LlamaForCausalLM
from specdec.models.lora import adapter_rows
from specdec.outputs import TokenLogprobs
from specdec.sampling import token_logprobs
from specdec.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

ATTENTION_BACKEND_ENV = "SPECDEC_ATTENTION_BACKEND"  # "triton": the CUDA path on the CPU, for tests
PROMPT_LOGPROB_ROWS = 256  # prompt rows given logits at once ([256, V] float32: 50 MB at V=49k)


@dataclass(slots=True)
class StepResult:
    """What one forward produced for the sequences that sample this step."""

    logits: torch.Tensor  # [M, V] float32: per sampling sequence, its draft rows then bonus row
    hidden_states: torch.Tensor  # [M, hidden] final hidden state at the same rows
    sample_indices: list[int]  # [S] index into SchedulerOutput.seqs of each sampling sequence
    num_logit_rows: list[int]  # [S] rows of each sampling sequence (its drafts + 1)
    query_starts: list[int] = field(default_factory=list)  # [B] position of each first query
    # [N, hidden] final hidden state at every query token of the step, in batch order (each
    # sequence's num_scheduled_tokens rows); None unless the drafter asked for it
    token_hidden_states: torch.Tensor | None = None
    # index into SchedulerOutput.seqs -> the logprobs of the prompt tokens this step's chunk
    # decided (SamplingParams.prompt_logprobs), continuing the sequence's prompt_logprobs
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # index into SchedulerOutput.seqs -> per-layer outputs at the query positions not kept
    # before, for sequences that ask (return_hidden_states, return_attentions)
    layer_outputs: dict[int, KeptLayers] = field(default_factory=dict)


@dataclass(slots=True)
class KeptLayers:
    """One sequence's per-layer outputs at ``n`` consecutive query positions of a step."""

    first: int  # the first position
    states: torch.Tensor  # [layers + 1, n, hidden] (see models/layer_outputs.py)
    attentions: torch.Tensor | None  # [layers, heads, n, first + n] where asked for


@dataclass(slots=True)
class QueryChunk:
    """One sequence's query tokens in a forward: what to feed, where, and how many logits."""

    token_ids: list[int]  # tokens to feed, at positions start .. start + len - 1
    start: int  # position of the first token (the tokens before it are in the KV cache)
    block_table: list[int]  # KV block ids covering every position fed
    num_logit_rows: int = 0  # logits wanted for this many last tokens
    lora_key: int = 0  # the LoRA adapter its tokens run through (0: none; see specdec.lora)

    @property
    def end(self) -> int:
        """The position after the last token fed."""
        return self.start + len(self.token_ids)

    def slots(self, block_size: int) -> list[int]:
        """The KV cache slot of each token fed (block id * block size + offset)."""
        table = self.block_table
        return [
            table[p // block_size] * block_size + p % block_size
            for p in range(self.start, self.end)
        ]


def kv_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (keys and values)."""
    cfg = model.config
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def _layer_rows(out: SchedulerOutput) -> dict[int, tuple[int, int, int]]:
    """Index into ``out.seqs`` -> (first flat row, rows, first position) of the query positions
    whose hidden states the sequence wants kept: those not kept before (a preempted sequence
    computes its positions again), for sequences that keep per-layer outputs."""
    wanted: dict[int, tuple[int, int, int]] = {}
    row = 0
    for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        start = seq.num_computed_tokens
        first = max(start, seq.num_kept_positions)
        if seq.params.keeps_layers and first < start + n:
            wanted[i] = (row + first - start, start + n - first, first)
        row += n
    return wanted


def _allocate_caches(
    shape: tuple[int, ...], dtype: torch.dtype, count: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``count`` zeroed KV tensors, half for keys and half for values, in one pool.

    The pool is on ordinary pages, not the 2 MB pages the weights get: the OS maps a page on
    its first write, and on this project's machine a first write cost about 9 ms per 2 MB
    page, 40-70 ms when the kernel had to gather free memory for one, against about 0.2 ms for
    the same 2 MB in 4 KB pages. The block manager hands out blocks all over the pool, so a
    1 GB pool on huge pages paid 3.5 s of page faults inside one 32-request run, step after
    step; weights, in contrast, are copied once at load.

    The pool is a fresh anonymous mapping, whose pages read as zeros and take memory only once
    written: ``torch.zeros`` writes every page at once, so a 1 GB pool was 1 GB resident from
    the start, however few blocks a workload used (``specdec.wrap`` beside a model of 540 MB).
    """
    if device.type == "cpu":
        pool = _zeroed_on_demand((count, *shape), dtype)
    else:
        pool = torch.zeros((count, *shape), dtype=dtype, device=device)
    caches = list(pool.unbind(0))
    return caches[: count // 2], caches[count // 2 :]


def _zeroed_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on an anonymous mapping (pages committed on first write), or from
    ``torch.zeros`` where ``mmap`` cannot map anonymous memory."""
    num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if num_bytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # keeps the map


class HostStaging:
    """A step's small host tensors reach the device in one copy, through one pinned buffer.

    Each tensor's bytes go to an 8-byte-aligned offset of a page-locked host buffer; one
    asynchronous copy moves the used part to the device, where every tensor is a view of it. Many
    small copies would each pay a launch and a synchronisation; vLLM stages its step inputs the
    same way. On the CPU there is nothing to copy. The buffer is written again only once the
    previous step's copy has finished (an event marks it).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.copied: torch.cuda.Event | None = None

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` on the device, views of one staged buffer."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0, *itertools.accumulate(-(-n // 8) * 8 for n in sizes)]
        if self.buffer.numel() < offsets[-1]:
            self.buffer = torch.empty(max(offsets[-1], 2 * self.buffer.numel()), dtype=torch.uint8)
            self.buffer = self.buffer.pin_memory()
        elif self.copied is not None:
            self.copied.synchronize()  # the previous copy still reads the buffer
        for t, start, n in zip(tensors, offsets, sizes):
            self.buffer[start : start + n] = t.contiguous().view(-1).view(torch.uint8)
        staged = self.buffer[: offsets[-1]].to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return [
            staged[start : start + n].view(t.dtype).view(t.shape)
            for t, start, n in zip(tensors, offsets, sizes)
        ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        shared_caches: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        cuda_graphs: bool = False,
        max_model_len: int = 0,
        max_num_seqs: int = 0,
    ):
        """``shared_caches``: another runner's KV tensors (keys, values), for a draft model of the
        same shape that reads the target's cache instead of keeping one (see
        drafters/draft_model.py); ``None`` allocates this runner's own.

        ``cuda_graphs``: run decode and verification steps as captured CUDA graphs (see
        :mod:`specdec.cuda_graphs`) for contexts up to ``max_model_len`` tokens and up to
        ``max_num_seqs`` sequences. The pool gets one block more than ``num_blocks``, the sink
        that padding tokens write to. On the CPU (tests, with the Triton attention path) the
        same path runs with each replay done eagerly."""
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.staging = HostStaging(self.device)
        # decodes and verifications through the Triton paged-attention kernel: on CUDA, or on
        # the CPU under Triton's interpreter when tests ask for it
        self.triton_attention = (
            self.device.type == "cuda" or os.environ.get(ATTENTION_BACKEND_ENV) == "triton"
        )
        if cuda_graphs and not self.triton_attention:
            raise ValueError(
                "cuda_graphs needs the CUDA path (device='cuda'): on the CPU every step already "
                "runs as a few C++ calls"
            )
        if cuda_graphs and (shared_caches is not None or min(max_model_len, max_num_seqs) < 1):
            raise ValueError(
                "cuda_graphs is for a runner with KV tensors of its own, sized by max_model_len "
                "and max_num_seqs"
            )
        cfg = model.config
        sink_block = num_blocks  # a block past the block manager's: padding tokens' K/V go there
        shape = (num_blocks + int(cuda_graphs), block_size, cfg.num_kv_heads, cfg.head_dim)
        if shared_caches is None:
            shared_caches = _allocate_caches(shape, dtype, 2 * cfg.num_layers, self.device)
        self.k_caches, self.v_caches = shared_caches
        for attn, k, v in zip(model.attention_layers, self.k_caches, self.v_caches):
            attn.k_cache, attn.v_cache = k, v
        self.graphs = (
            StepGraphs(model, block_size, sink_block, max_model_len, max_num_seqs)
            if cuda_graphs
            else None
        )

    def run(self, out: SchedulerOutput, keep_token_hidden_states: bool = False) -> StepResult:
        """One target forward over every scheduled sequence's query tokens (the hidden state of
        each kept with ``keep_token_hidden_states``), after the step's block copies."""
        if out.copies:
            self.copy_blocks(out.copies)
        chunks: list[QueryChunk] = []
        sample_indices: list[int] = []
        num_logit_rows: list[int] = []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n]  # then drafts fill the rest of the query
            tokens += seq.spec_token_ids[: n - len(tokens)]
            rows = len(seq.spec_token_ids) + 1 if out.samples(i) else 0
            chunks.append(QueryChunk(tokens, start, seq.block_table, rows, seq.lora_key))
            if rows:
                sample_indices.append(i)
                num_logit_rows.append(rows)
        asked = any(seq.params.keeps_layers for seq in out.seqs)
        wanted = _layer_rows(out) if asked else {}
        layer_rows = [r for row, n, _ in wanted.values() for r in range(row, row + n)]
        probes = self._probes(out, wanted) if asked else []
        logits, hidden, token_hidden, layers = self.forward(chunks, layer_rows or None, probes)
        kept = token_hidden if keep_token_hidden_states else None
        starts = [c.start for c in chunks]
        prompt = (  # most steps: no sequence asked (the check costs a tenth of the call)
            self._prompt_logprobs(out, token_hidden)
            if any(seq.params.prompt_logprobs is not None for seq in out.seqs)
            else {}
        )
        res = StepResult(logits, hidden, sample_indices, num_logit_rows, starts, kept, prompt)
        offset, attentions = 0, iter(layers[1] if layers else ())
        for i, (_, n, first) in wanted.items():
            probs = next(attentions) if out.seqs[i].params.return_attentions else None
            states = layers[0][:, offset : offset + n]  # type: ignore[index]
            res.layer_outputs[i] = KeptLayers(first, states, probs)
            offset += n
        return res

    def _probes(
        self, out: SchedulerOutput, wanted: dict[int, tuple[int, int, int]]
    ) -> list[AttentionProbe]:
        """The attention probes of the sequences that ask for attentions, in ``wanted``'s
        order (see :mod:`specdec.models.layer_outputs`)."""
        probes, offset = [], 0
        for i, (row, n, first) in wanted.items():
            seq = out.seqs[i]
            if seq.params.return_attentions:
                slots = QueryChunk([0] * (first + n), 0, seq.block_table).slots(self.block_size)
                rows, kept, positions = (
                    torch.arange(a, a + n, device=self.device) for a in (row, offset, first)
                )
                probes.append(
                    AttentionProbe(rows, kept, positions, torch.tensor(slots, device=self.device))
                )
            offset += n
        return probes

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, (source, destination) pairs, in every layer."""
        sources = torch.tensor([c[0] for c in copies], device=self.device)
        targets = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in (*self.k_caches, *self.v_caches):
            cache[targets] = cache[sources]

    @torch.inference_mode()
    def _prompt_logprobs(
        self, out: SchedulerOutput, token_hidden: torch.Tensor
    ) -> dict[int, list[TokenLogprobs]]:
        """The logprobs of the prompt tokens whose preceding position this step computed, for
        sequences that asked (positions already scored before a preemption are skipped)."""
        result: dict[int, list[TokenLogprobs]] = {}
        end_row = 0  # flat row after the sequence's last query token
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            end_row += n
            num_top = seq.params.prompt_logprobs
            if num_top is None or not seq.needs_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            row_of = end_row - n - start  # + position = the position's row
            first = max(start, len(seq.prompt_logprobs))  # the position deciding token first + 1
            end = min(start + n, seq.num_prompt_tokens - 1)
            lps = result[i] = []
            for a in range(first, end, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, end)
                logits = self.model.compute_logits(token_hidden[row_of + a : row_of + b])
                lps += token_logprobs(logits, seq.token_ids[a + 1 : b + 1], num_top)
        return result

    @torch.inference_mode()
    def forward(
        self,
        chunks: list[QueryChunk],
        layer_rows: list[int] | None = None,
        probes: list[AttentionProbe] | None = None,
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None
    ]:
        """Run ``chunks`` as one flat batch; return logits [M, V] float32, the hidden states
        at those rows [M, H] and at every token fed [N, H], and, for the flat ``layer_rows``,
        every layer's states [layers + 1, R, H] and the ``probes``' attention probabilities
        (see :func:`specdec.models.layer_outputs.forward_with_layers`; else None).

        ``M`` is the sum of the chunks' ``num_logit_rows``: each chunk's last rows, in order.
        Decodes and verifications replay a CUDA graph where the runner has them.
        """
        if self.graphs is not None and layer_rows is None and self.graphs.takes(chunks):
            try:
                hidden = self.graphs.run(chunks, self.staging)  # every token is a logit row
            except CaptureError as error:
                logger.warning("%s; running without CUDA graphs from now on", error)
                self.graphs = None
            else:
                return self.model.compute_logits(hidden).float(), hidden, hidden, None
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []  # flat index of each row that needs logits
        bs = self.block_size
        for c in chunks:
            input_ids += c.token_ids
            positions += range(c.start, c.end)
            slots += c.slots(bs)
            logit_rows += range(len(input_ids) - c.num_logit_rows, len(input_ids))
        step = torch.tensor([input_ids, positions, slots], dtype=torch.long)  # [3, N]
        meta = AttentionMetadata.build(
            [len(c.token_ids) for c in chunks],
            [c.end for c in chunks],
            [c.block_table for c in chunks],
            step[2],
            bs,
            self.model.batch_invariant,
            self.triton_attention,
        )
        rows_index = torch.tensor(logit_rows, dtype=torch.long)
        if self.device.type != "cpu":
            step, rows_index, *meta_tensors = self.staging.to_device(
                [step, rows_index, *meta.tensors()]
            )
            meta.replace_tensors(meta_tensors)
        layers = None
        with adapter_rows(self.model, chunks):  # which rows each LoRA adapter takes
            if layer_rows is None:
                hidden = self.model(step[0], step[1], meta)
            else:
                kept = torch.tensor(layer_rows, dtype=torch.long, device=self.device)
                hidden, states, probs = forward_with_layers(
                    self.model, step[0], step[1], meta, kept, probes
                )
                layers = states, probs
        rows = hidden[rows_index]
        return self.model.compute_logits(rows).float(), rows, hidden, layers

    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int) -> None:
        """One forward of a made-up ``num_tokens`` prompt with logits at every token, as a step
        verifying ``num_tokens`` query tokens needs; for timing, and only before serving (it
        writes K/V into the first blocks of the pool, harmless only while none is in use)."""
        num_tokens = min(num_tokens, self.k_caches[0].shape[0] * self.block_size)
        blocks = list(range(-(-num_tokens // self.block_size)))
        chunk = QueryChunk([0] * num_tokens, 0, blocks, num_tokens)
        self.forward([chunk])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timed by the caller: wait for the GPU
