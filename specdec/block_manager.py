"""KV block bookkeeping: block ids, reference counts, the free list and the prefix cache.

The block manager is the only owner of block ids. It never touches KV memory: the model runner
holds the tensors and indexes them with the ids handed out here.

Prefix caching (as in vLLM's automatic prefix caching): once a block is full of computed, final
tokens, it is registered under a hash chained from the previous block's hash and its own token
ids, so equal prefixes get equal hashes. A later request whose prompt starts with the same blocks
takes them (reference count + 1) instead of recomputing them. A freed block keeps its hash while
it waits on the free list; it is evicted, least recently freed first, only when reallocated.

A sequence's last, partial block is cached too when the sequence is freed: its computed tokens
are registered under a hash of their own (chained from the full block before). A later sequence
whose tokens continue those (a beam extended by one token, the next turn of a conversation) takes
a fresh block and a copy of that block's K/V instead of recomputing up to ``block_size - 1``
tokens: the source block is pinned until the step's copies are done (:meth:`take_copies`,
:meth:`release_copies`; the model runner copies), since it may not be shared and written.

A sequence that runs through a LoRA adapter computes other K/V for the same tokens, so its hash
chain starts from its adapter's key (vLLM's rule): blocks are shared between sequences of one
adapter, never across adapters or with the base model.
"""

from __future__ import annotations

from collections import OrderedDict

from specdec.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation cannot be served; the scheduler checks first and preempts."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # hash of a registered block
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        # Free blocks in eviction order (oldest first); an OrderedDict gives O(1) removal of a
        # cached block revived by a prefix hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.copies: dict[int, int] = {}  # pending K/V copies of partial blocks: new -> cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that ``seq`` can hold KV for its first ``num_tokens`` positions."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` positions."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} KV blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            block_id, _ = self.free_blocks.popitem(last=False)
            self._forget_hash(block_id)
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence without blocks the cached blocks of its longest registered prefix.

        At most ``num_tokens - 1`` tokens are taken from the cache, so that the last token is
        always computed and yields logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        parent = _root(seq)
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_hash = self.hash_block(parent, seq.token_ids, i)
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            self._hold(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_computed_tokens += self._match_partial(seq, parent)
        seq.metrics.num_cached_tokens = max(seq.metrics.num_cached_tokens, seq.num_computed_tokens)

    def _match_partial(self, seq: Sequence, parent: int | None) -> int:
        """After ``seq``'s full cached blocks, the cached partial block that holds the most of its
        next tokens (never its last): a fresh block for it, to be filled with a copy. Returns the
        tokens it covers (0: none cached, or no block free for the copy)."""
        start = len(seq.block_table) * self.block_size
        tokens = seq.token_ids[start : min(seq.num_tokens - 1, start + self.block_size - 1)]
        source = None
        while tokens and source is None:  # the longest cached run of them
            source = self.cached_blocks.get(self.hash_partial(parent, tokens))
            if source is None:
                tokens = tokens[:-1]
        if source is None or len(self.free_blocks) < 1 + (self.ref_counts[source] == 0):
            return 0
        self._hold(source)  # until the copy is done
        block_id, _ = self.free_blocks.popitem(last=False)
        self._forget_hash(block_id)
        self.ref_counts[block_id] = 1
        seq.block_table.append(block_id)
        self.copies[block_id] = source
        return len(tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the next forward needs first, handed over
        once; each source stays held until :meth:`release_copies`."""
        copies = [(source, block_id) for block_id, source in self.copies.items()]
        self.copies.clear()
        return copies

    def release_copies(self, copies: list[tuple[int, int]]) -> None:
        for source, _ in copies:
            self._release(source)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register each block now full of computed, final tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else _root(seq)
            block_hash = self.hash_block(parent, seq.token_ids, i)
            seq.block_hashes.append(block_hash)
            block_id = seq.block_table[i]
            if block_hash not in self.cached_blocks and self.block_hash[block_id] is None:
                self.cached_blocks[block_hash] = block_id
                self.block_hash[block_id] = block_hash

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, its last partial one cached; the tail goes on the free
        list first (evicted first)."""
        self._register_partial(seq)
        for block_id in reversed(seq.block_table):
            source = self.copies.pop(block_id, None)  # freed before its copy was made
            if source is not None:
                self._release(source)
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def _register_partial(self, seq: Sequence) -> None:
        """Cache the computed tokens of ``seq``'s last, partial block (see the module doc)."""
        if not self.enable_prefix_caching:
            return
        computed = min(seq.num_computed_tokens, seq.num_tokens)
        full, rest = divmod(computed, self.block_size)
        if not rest or full >= len(seq.block_table) or len(seq.block_hashes) < full:
            return
        block_id = seq.block_table[full]  # (a copy still pending has the source's key: skipped)
        start = full * self.block_size
        parent = seq.block_hashes[full - 1] if full else _root(seq)
        key = self.hash_partial(parent, seq.token_ids[start : start + rest])
        if self.ref_counts[block_id] == 1 and key not in self.cached_blocks:
            self.cached_blocks[key] = block_id
            self.block_hash[block_id] = key

    def _hold(self, block_id: int) -> None:
        """One more holder of a cached block (off the free list if it was there)."""
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (vLLM's ``reset_prefix_cache``), so
        that later requests compute their prompts anew: benchmarks that replay prompts use it."""
        for block_id in self.free_blocks:
            self._forget_hash(block_id)

    def hash_block(self, parent: int | None, token_ids: list[int], index: int) -> int:
        start = index * self.block_size
        return hash((parent, tuple(token_ids[start : start + self.block_size])))

    @staticmethod
    def hash_partial(parent: int | None, tokens: list[int]) -> int:
        """A partial block's key: its tokens after the full block ``parent`` (another domain
        than full blocks' hashes)."""
        return hash(("partial", parent, tuple(tokens)))

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None


def _root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: none for the base model, else its adapter's."""
    return hash(("lora", seq.lora_key)) if seq.lora_key else None
