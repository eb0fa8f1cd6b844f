"""GPTConfig: the shape of a GPT-style model, validated once, with named presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..mesh.layout import require_positive

_NORMS = ("rmsnorm", "layernorm")
_ACTIVATIONS = ("swiglu", "gelu")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256            # tokens; the byte-level tokenizer uses 256
    n_layers: int = 4                # Transformer blocks
    d_model: int = 128               # hidden size
    n_heads: int = 4                 # query heads
    n_kv_heads: int | None = None    # key/value heads (grouped-query attention); None = n_heads
    d_ff: int | None = None          # MLP inner size; None = 4*d_model (gelu) or ~8/3*d (swiglu)
    max_seq_len: int = 256           # longest sequence (rotary tables are built for it)
    norm: str = "rmsnorm"            # "rmsnorm" | "layernorm"
    activation: str = "swiglu"       # "swiglu" | "gelu"
    rotary: bool = True              # rotary position embedding; else learned absolute positions
    rotary_base: float = 10000.0
    dropout: float = 0.0             # on attention output and MLP output (residual branches)
    tie_embeddings: bool = False     # the head reuses the token embedding
    bias: bool = False               # biases in the linear layers
    norm_eps: float = 1e-5
    pad_vocab_to: int = 128          # the vocabulary is padded to a multiple of this (for TP)
    init_seed: int = 0               # every module's weights come from (init_seed, its position)
    n_experts: int = 0               # experts in each block's MLP (mixture of experts); 0: dense
    moe_top_k: int = 2               # experts each token goes to
    moe_ffn: int | None = None       # an expert's inner size; None = ffn_dim
    moe_shared_experts: int = 0      # shared experts: one dense SwiGLU of this many experts' size
    moe_shared_gate: bool = False    # scale the shared experts' output by sigmoid(x w) (Qwen2-MoE)
    moe_capacity_factor: float = 0.0  # an expert takes at most this x its fair share; 0: dropless
    moe_aux_loss: float = 0.01       # the load-balancing auxiliary loss's coefficient
    moe_norm_topk: bool = True       # renormalise the top-k router weights to sum to 1 (Mixtral)
    moe_bias_rate: float = 0.0       # auxiliary-loss-free balancing: the router bias's step per
                                     # optimizer step (DeepSeek-V3); 0: off

    def __post_init__(self):
        require_positive({k: getattr(self, k) for k in ("vocab_size", "n_layers", "d_model",
                                                        "n_heads", "max_seq_len",
                                                        "pad_vocab_to")}, "GPTConfig: ")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"GPTConfig: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.norm not in _NORMS:
            raise ValueError(f"GPTConfig: norm={self.norm!r} is not one of {_NORMS}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"GPTConfig: activation={self.activation!r} is not one of "
                             f"{_ACTIVATIONS}")
        if self.rotary and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary needs an even head_dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")
        if self.n_experts:      # (0: dense)
            bad = {k: getattr(self, k) for k, ok in (
                ("n_experts", self.n_experts >= 2),
                ("moe_top_k", 1 <= self.moe_top_k <= self.n_experts),
                ("moe_ffn", self.moe_ffn is None or self.moe_ffn >= 1),
                ("moe_shared_experts", self.moe_shared_experts >= 0),
                ("moe_capacity_factor", self.moe_capacity_factor >= 0),
                ("moe_aux_loss", self.moe_aux_loss >= 0),
                ("moe_bias_rate", self.moe_bias_rate >= 0),
                ("activation", self.activation == "swiglu")) if not ok}
            if bad:
                raise ValueError(f"GPTConfig: mixture of experts with {bad}: needs n_experts >= "
                                 f"2, 1 <= moe_top_k <= n_experts, moe_ffn >= 1, the "
                                 f"moe_ counts and rates >= 0 and activation 'swiglu'")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.activation == "gelu":
            return 4 * self.d_model
        return 64 * ((8 * self.d_model // 3 + 63) // 64)   # swiglu: ~8/3 d, a multiple of 64

    @property
    def expert_ffn(self) -> int:
        """An expert's inner size (MoE)."""
        return self.moe_ffn or self.ffn_dim

    @property
    def padded_vocab(self) -> int:
        m = self.pad_vocab_to
        return m * ((self.vocab_size + m - 1) // m)

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming the sizes that tensor parallelism of degree ``tp`` cannot split."""
        for name, value in (("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads),
                            ("d_ff", self.ffn_dim), ("padded vocab", self.padded_vocab)):
            if value % tp:
                raise ValueError(f"GPTConfig: {name}={value} is not divisible by tp={tp}")

    def layer_params(self, ep: int = 1) -> int:
        """Parameters of one Transformer block (all TP ranks; weights of the projections and
        the MLP, their biases, and the two norms); ``ep``: on one expert-parallel rank (its
        n_experts / ep experts)."""
        d, f, hd = self.d_model, self.ffn_dim, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.kv_heads * hd) * 2
        mlp = d * f * (3 if self.activation == "swiglu" else 2)
        if self.n_experts:      # every expert, the shared ones, the router (and its gate)
            mlp = self.moe_params(ep)
        elif self.bias:         # the column linears' biases (the row ones': replicated)
            mlp += f * (2 if self.activation == "swiglu" else 1)
        if self.bias:
            attn += (self.n_heads + 2 * self.kv_heads) * hd
        return attn + mlp + self.replicated_layer_params()

    def replicated_layer_params(self) -> int:
        """Parameters of one block every TP rank holds whole: the two norms (scale, and bias
        for LayerNorm) and the row-parallel linears' biases (o, and the MLP's last)."""
        d = self.d_model
        return 2 * d * (2 if self.norm == "layernorm" else 1) + \
            (d * (1 if self.n_experts else 2) if self.bias else 0)

    def moe_params(self, ep: int = 1) -> int:
        """Parameters of one block's MoE layer on one expert-parallel rank (its experts, the
        shared ones, the router and its gate); 0 for a dense model. Not split over TP."""
        if not self.n_experts:
            return 0
        return 3 * self.d_model * self.expert_ffn * (self.n_experts // ep +
                                                     self.moe_shared_experts) + \
            self.d_model * (self.n_experts + self.moe_shared_gate)

    def routed_expert_params(self) -> int:
        """Parameters of one block's routed experts (what expert parallelism splits)."""
        return 3 * self.d_model * self.expert_ffn * self.n_experts if self.n_experts else 0

    def num_params(self) -> int:
        """Parameters of the full model (padded vocabulary), for FLOP and memory estimates."""
        d = self.d_model
        emb = self.padded_vocab * d
        pos = 0 if self.rotary else self.max_seq_len * d
        return self.n_layers * self.layer_params() + emb * (1 if self.tie_embeddings else 2) \
            + pos + d

    def layer_flops(self, seq_len: int, tokens: int = 1,
                    span: float | None = None) -> dict[str, float]:
        """Forward FLOPs of one layer for ``tokens`` tokens of ``seq_len``-long sequences, by
        part: the attention projections, attention's core (QK^T and PV over every key, as
        Megatron counts it) and the MLP. ``span`` (packed documents): the keys a token's
        document holds on average, instead of the whole sequence's
        (:func:`fastpar.data.packing.attention_span`)."""
        h, d, a, g, f = self.d_model, self.head_dim, self.n_heads, self.kv_heads, self.ffn_dim
        mlp = 2.0 * tokens * h * f * (3 if self.activation == "swiglu" else 2)
        if self.n_experts:      # each token through top_k experts and the shared ones; router
            mlp = 2.0 * tokens * h * (3 * self.expert_ffn * (self.moe_top_k +
                                                             self.moe_shared_experts)
                                      + self.n_experts)
        return {"qkvo": 2.0 * tokens * h * (2 * a * d + 2 * g * d),
                "core": 4.0 * tokens * (span or seq_len) * a * d, "mlp": mlp}

    def train_flops(self, seq_len: int, tokens: int = 1, recompute: str = "none",
                    span: float | None = None) -> float:
        """FLOPs of forward and backward (3x the forward) of ``tokens`` tokens through the
        whole model, plus what ``recompute`` computes again. The one count behind the MFU the
        trainer reports, the MFU the planner predicts and the pipeline's stage balance.
        ``span``: as in :meth:`layer_flops`."""
        fl = self.layer_flops(seq_len, tokens, span)
        extra = {"none": 0.0, "selective": fl["core"], "full": sum(fl.values())}[recompute]
        return 3.0 * (self.n_layers * sum(fl.values()) + self._head_flops(tokens)) \
            + self.n_layers * extra

    def piece_flops(self, seq_len: int, span: float | None = None) -> list[float]:
        """Training FLOPs per token of [embedding, layer 0, ..., layer n-1, head]: the costs
        :func:`fastpar.pipeline.partition` balances stages by (the embedding is a gather,
        costed at 6 per output element as the pipeline costs any embedding)."""
        layer = 3.0 * sum(self.layer_flops(seq_len, span=span).values())
        return [6.0 * self.d_model] + [layer] * self.n_layers + [3.0 * self._head_flops(1)]

    def _head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.d_model * self.padded_vocab

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


PRESETS: dict[str, GPTConfig] = {
    # Trains on a CPU in minutes: byte vocabulary, no dropout.
    "tiny": GPTConfig(vocab_size=256, n_layers=4, d_model=128, n_heads=4, max_seq_len=256),
    "small": GPTConfig(vocab_size=256, n_layers=8, d_model=256, n_heads=8, max_seq_len=512),
    # tiny with a mixture of 4 experts of half the MLP's size, 2 per token (the same active
    # FLOPs as tiny)
    "tiny-moe": GPTConfig(vocab_size=256, n_layers=4, d_model=128, n_heads=4, max_seq_len=256,
                          n_experts=4, moe_top_k=2, moe_ffn=192),
    "gpt2-124m": GPTConfig(vocab_size=50257, n_layers=12, d_model=768, n_heads=12,
                           max_seq_len=1024, norm="layernorm", activation="gelu", rotary=False,
                           tie_embeddings=True, bias=True),
    "1b": GPTConfig(vocab_size=32000, n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4,
                    d_ff=5632, max_seq_len=2048),
    "7b": GPTConfig(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, d_ff=11008,
                    max_seq_len=4096),
    "70b": GPTConfig(vocab_size=32000, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                     d_ff=28672, max_seq_len=4096),
    # Mixtral 8x7B's shape: 8 experts of 14336, 2 per token
    "8x7b": GPTConfig(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                      d_ff=14336, max_seq_len=4096, n_experts=8, moe_top_k=2),
}


def get_config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
