"""CUDA graphs for decode and verification steps: one replay instead of a thousand launches.

A decode step of the default model runs about 1,850 torch operators, some 1,100 of which launch a
kernel; on a GPU its time is the host's launching, not the device's work (an H200 spent 33 ms
on a step whose weights it reads in 60 µs). A CUDA graph records the launches of one forward
once and replays them with a single call, as vLLM does for its decode batches.

A graph replays fixed shapes and addresses, so a step is padded to a *bucket*: ``B`` sequences
and ``T`` query tokens (decodes and verifications only: every token's logits are wanted) run in
the graph of ``(bucket(B), bucket(T), q)``, buckets being powers of two up to the engine's
limits and ``q`` the longest query's bucket (the attention kernel's tile size). Graphs are
captured when a bucket is first met; all share one memory pool and read their inputs from one
set of static buffers, which each step overwrites:

* tokens, positions and KV slots ``[3, T]``: padding tokens are token 0 at position 0, and write
  their K/V into the *sink block*, a block of the pool that the block manager never hands out;
* the attention kernel's ``cu_query_lens``, ``seq_lens`` and block tables: padding sequences have
  no queries and no context, so the kernel does nothing for them.

Padding rows compute garbage that no real row reads: linears, norms and activations work row by
row, and attention reads only the cache. The hidden states are copied out of the graph's
buffers before the next replay can overwrite them; the output layer runs after the graph, on the
real rows only.

Steps a graph does not take run eagerly: prompt chunks (wider queries, SDPA) and steps beyond
the largest bucket. Should a capture fail, the runner logs why and runs every step eagerly from
then on: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from specdec.attention import NARROW_QUERY, AttentionMetadata, PagedBatch

if TYPE_CHECKING:
    from specdec.models.llama import LlamaForCausalLM
    from specdec.runner import HostStaging, QueryChunk

MAX_GRAPH_TOKENS = 512  # the largest token bucket (vLLM's default largest graph is 512 too)


class Graph(Protocol):
    """A recorded forward: :meth:`capture` records ``fn`` and returns its output tensor, which
    every :meth:`replay` rewrites in place from the static inputs' current values."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph``, warmed up first on a side stream (Triton compiles its kernels
    and cuBLAS makes its workspace there, outside the capture), as torch's documentation does."""

    def __init__(self, pool: Any):  # torch.cuda.graph_pool_handle()
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            output = fn()
        return output

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The same contract without CUDA: each replay runs ``fn`` again and copies its results into
    the captured output. The CPU tests run the whole graph path (buckets, static buffers,
    padding, the sink block) through it; only the recording itself needs a GPU."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.output = fn, fn()
        return self.output

    def replay(self) -> None:
        assert self.fn is not None and self.output is not None
        self.output.copy_(self.fn())


class CaptureError(RuntimeError):
    """A step's forward could not be recorded; the runner goes on without graphs."""


@dataclass(frozen=True, slots=True)
class GraphKey:
    num_seqs: int  # padded sequences
    num_tokens: int  # padded query tokens
    max_query_len: int  # the attention kernel's tile hint


def bucket(n: int, cap: int) -> int:
    """The power of two at or above ``n``, at most ``cap`` (``n <= cap``)."""
    return min(1 << (n - 1).bit_length(), cap)


class StepGraphs:
    """The captured forwards of one model runner, by bucket, and the buffers they read."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        sink_block: int,
        max_model_len: int,
        max_num_seqs: int,
        max_tokens: int = MAX_GRAPH_TOKENS,
    ):
        self.model = model
        self.block_size = block_size
        self.sink_slot = sink_block * block_size
        self.max_tokens = max_tokens
        self.max_seqs = min(max_num_seqs, max_tokens)
        self.max_blocks = -(-max_model_len // block_size)
        device = self.device = model.embed_tokens.weight.device
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device)  # ids, pos, slot
        self.cu_query_lens = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            self.max_seqs, self.max_blocks, dtype=torch.int32, device=device
        )
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[GraphKey, tuple[Graph, torch.Tensor]] = {}

    def takes(self, chunks: list[QueryChunk]) -> bool:
        """Whether a graph can run this step: decodes and verifications only (each sequence
        with cached context, a narrow query and logits at every query token), within the
        largest bucket."""
        if not chunks or len(chunks) > self.max_seqs:
            return False
        total = 0
        for c in chunks:
            n = len(c.token_ids)
            if not (c.start > 0 and 0 < n <= NARROW_QUERY and c.num_logit_rows == n):
                return False
            if -(-c.end // self.block_size) > self.max_blocks:
                return False
            total += n
        return total <= self.max_tokens

    def run(self, chunks: list[QueryChunk], staging: HostStaging) -> torch.Tensor:
        """The final hidden states [T, H] at every query token of ``chunks`` (a step
        :meth:`takes`), by replaying the graph of its bucket. Logits are left to the caller: a
        graph holding ``[T, V]`` float32 outputs for each bucket would take 100 MB for 512
        tokens of the default model, and the output layer is one launch."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        key = GraphKey(
            bucket(len(chunks), self.max_seqs),
            bucket(num_tokens, self.max_tokens),
            bucket(max(len(c.token_ids) for c in chunks), NARROW_QUERY),
        )
        self._write_inputs(chunks, key, staging)
        if key not in self.graphs:
            new: Graph = EagerGraph() if self.pool is None else CudaGraph(self.pool)
            try:
                self.graphs[key] = new, new.capture(self._forward_fn(key))
            except RuntimeError as error:  # e.g. an op that waits on the device, not capturable
                raise CaptureError(f"capturing the graph of {key} failed: {error}") from error
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:num_tokens].clone()

    def _write_inputs(self, chunks: list[QueryChunk], key: GraphKey, staging: HostStaging) -> None:
        """This step's inputs, padded to ``key``, into the static buffers."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_query_lens = [0]
        seq_lens = []
        bs = self.block_size
        for c in chunks:
            ids += c.token_ids
            positions += range(c.start, c.end)
            slots += c.slots(bs)
            cu_query_lens.append(len(ids))
            seq_lens.append(c.end)
        pad_tokens = key.num_tokens - len(ids)
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [self.sink_slot] * pad_tokens
        pad_seqs = key.num_seqs - len(chunks)
        cu_query_lens += [cu_query_lens[-1]] * pad_seqs
        seq_lens += [0] * pad_seqs
        width = max(-(-n // bs) for n in seq_lens)
        tables = [
            c.block_table[:width] + [0] * (width - len(c.block_table[:width])) for c in chunks
        ]
        host = [
            torch.tensor([ids, positions, slots], dtype=torch.long),
            torch.tensor(cu_query_lens, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32).view(len(chunks), width),
        ]
        if self.device.type != "cpu":
            host = staging.to_device(host)
        step, cu, lens, table = host
        self.tokens[:, : key.num_tokens].copy_(step)
        self.cu_query_lens[: key.num_seqs + 1].copy_(cu)
        self.seq_lens[: key.num_seqs].copy_(lens)
        self.block_tables[: len(chunks), :width].copy_(table)  # the kernel reads no further

    def _forward_fn(self, key: GraphKey) -> Callable[[], torch.Tensor]:
        """The forward a graph records: the model over the first ``key`` entries of the buffers."""
        tokens = self.tokens[:, : key.num_tokens]
        paged = PagedBatch(
            self.cu_query_lens[: key.num_seqs + 1],
            self.seq_lens[: key.num_seqs],
            self.block_tables[: key.num_seqs],
            key.max_query_len,
        )
        meta = AttentionMetadata(tokens[2], [], [], dense=True, invariant=False, paged=paged)

        return lambda: self.model(tokens[0], tokens[1], meta)
