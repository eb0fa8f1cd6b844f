"""Context parallelism (CP): each sequence split over ``cp`` ranks, attention by a ring.

Layout (:mod:`.sharding`): the sequence is cut into ``2 * cp`` chunks and CP rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r``, so every rank has as much causal attention to compute as
every other (Megatron-Core, Llama 3). Everything but attention is per token and needs nothing
from the other ranks, given each token's true position (:func:`positions`).

The ring (:mod:`.ring_attention`): in ``cp`` steps each rank's k/v visits every rank, passed to
rank ``r + 1`` while the current block computes; each block is a fused SDPA kernel call in the
activations' dtype (:mod:`.blocks`), and blocks merge by their log-sum-exp (online softmax,
fp32). Backward sends the k/v around again, with each block's dk/dv accumulator one hop behind,
and a last hop brings it home to the owner of that k/v. The ring is the custom ops
``fastpar::ring_attention_fwd`` / ``fastpar::ring_attention_bwd``, opaque to ``torch.compile``.
"""
from .ring_attention import ring_attention, ring_attention_bwd, ring_attention_fwd
from .sharding import check_seq_len, positions, shard_sequence, unshard_sequence, visible_block

__all__ = ["check_seq_len", "positions", "ring_attention", "ring_attention_bwd",
           "ring_attention_fwd", "shard_sequence", "unshard_sequence", "visible_block"]
