"""Hugging Face checkpoints in and out: Llama (``LlamaForCausalLM``), GPT-2
(``GPT2LMHeadModel``) and the mixtures of experts Mixtral (``MixtralForCausalLM``) and Qwen2-MoE
(``Qwen2MoeForCausalLM``).

A Hugging Face directory holds ``config.json`` and ``*.safetensors`` (one file, or shards named by
``model.safetensors.index.json``). :func:`config_from_hf` maps its config onto a
:class:`GPTConfig` (or refuses, naming the field fastpar cannot represent); :func:`load_hf`
fills a GPT chunk of any (tp, pp) layout, each rank reading only the rows or columns it holds
(safetensors slices, no full copy); the padded vocabulary rows are zero. :func:`hf_state_dict`
and :func:`save_hf` go back: full tensors of a whole model, the padding dropped.

The names follow the checkpoint's (:func:`fastpar.tensor_parallel.sharding.shard_specs`:
``attn.q``, ``mlp.gate``, ...), one rule per family. GPT-2's Conv1D weights are stored
transposed ((in, out)) and its q, k, v live in one ``c_attn``: they are transposed and cut on the
way in and joined on the way out. An expert is one tensor per projection in the directory
(transformers 4's layout: ``experts.{e}.w1`` / ``gate_proj``, ...) and a slice of fastpar's stacked
``experts.gate_up`` (E, 2F, D) / ``experts.down`` (E, D, F): they are stacked on the way in and
cut on the way out. The ``--init-from`` checks: :mod:`fastpar.train.init_from`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

from .config import GPTConfig
from .moe import moe_layers
from ..tensor_parallel.sharding import shard_specs

_LLAMA_LAYER = {"self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k",
                "self_attn.v_proj": "attn.v", "self_attn.o_proj": "attn.o",
                "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
                "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
_GPT2_LAYER = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_proj": "attn.o", "mlp.c_fc": "mlp.up",
               "mlp.c_proj": "mlp.down"}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_LLAMA_FAMILY = ("llama", "mixtral", "qwen2_moe")     # Llama's names outside the MLP
# A sparse block's name and its experts' gate, up and down projections
_MOE = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
        "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _refuse(field: str, value, why: str):
    raise ValueError(f"Hugging Face config: {field}={value!r} {why}")


_REQUIRED = object()


def _field(hf: dict, key: str, kind: type, default=_REQUIRED):
    """``hf[key]`` as a positive int or a float (``default`` when absent or null, if it has
    one): a missing or ill-typed field is one error naming it, not a KeyError or TypeError."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"Hugging Face config: {key} is missing")
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    whole = number and (isinstance(value, int) or value.is_integer())   # 64.0 is 64
    if kind is int and not (whole and value >= 1):
        _refuse(key, value, "is not a positive integer")
    if not number:
        _refuse(key, value, "is not a number")
    return kind(value)


def config_from_hf(hf: dict, pad_vocab_to: int = 128) -> GPTConfig:
    """The GPTConfig of a Hugging Face ``config.json`` (as a dict); one error naming the field
    for what fastpar cannot represent, or a field missing or of the wrong type."""
    if not isinstance(hf, dict):
        raise ValueError(f"Hugging Face config: not a JSON object but {type(hf).__name__}")
    kind = hf.get("model_type")
    if kind == "llama":
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            _refuse("attention_bias", hf.get("attention_bias"), "must equal mlp_bias "
                    f"({hf.get('mlp_bias')!r}): fastpar's layers have biases everywhere or nowhere")
        return GPTConfig(**_llama_like(hf, 10000.0, 1e-6),
                         d_ff=_field(hf, "intermediate_size", int),
                         bias=bool(hf.get("attention_bias", False)), pad_vocab_to=pad_vocab_to)
    if kind == "mixtral":
        base = _llama_like(hf, 1e6, 1e-5)
        window = _field(hf, "sliding_window", int, None)
        if window is not None and window < base["max_seq_len"]:
            _refuse("sliding_window", window, f"< max_position_embeddings="
                    f"{base['max_seq_len']} is not supported (fastpar's attention is full causal)")
        if hf.get("router_jitter_noise"):
            _refuse("router_jitter_noise", hf["router_jitter_noise"],
                    "is not supported (fastpar's router has no jitter)")
        return GPTConfig(**base, d_ff=_field(hf, "intermediate_size", int),
                         n_experts=_field(hf, "num_local_experts", int),
                         moe_top_k=_field(hf, "num_experts_per_tok", int),
                         moe_aux_loss=_field(hf, "router_aux_loss_coef", float, 0.001),
                         moe_norm_topk=True, pad_vocab_to=pad_vocab_to)
    if kind == "qwen2_moe":
        if hf.get("use_sliding_window"):
            _refuse("use_sliding_window", hf["use_sliding_window"],
                    "is not supported (fastpar's attention is full causal)")
        if _field(hf, "decoder_sparse_step", int, 1) != 1:
            _refuse("decoder_sparse_step", hf["decoder_sparse_step"], "is not supported (dense "
                    "MLPs between the sparse ones: fastpar has experts in every layer)")
        if hf.get("mlp_only_layers"):
            _refuse("mlp_only_layers", hf["mlp_only_layers"], "is not supported (dense MLP "
                    "layers: fastpar has experts in every layer)")
        ffn = _field(hf, "moe_intermediate_size", int)
        shared = _field(hf, "shared_expert_intermediate_size", int)
        if shared % ffn:
            _refuse("shared_expert_intermediate_size", shared, f"is not a multiple of "
                    f"moe_intermediate_size={ffn} (fastpar's shared experts are n experts' size)")
        return GPTConfig(**_llama_like(hf, 10000.0, 1e-6),
                         d_ff=_field(hf, "intermediate_size", int, None),
                         bias=bool(hf.get("qkv_bias", True)),
                         n_experts=_field(hf, "num_experts", int),
                         moe_top_k=_field(hf, "num_experts_per_tok", int), moe_ffn=ffn,
                         moe_shared_experts=shared // ffn, moe_shared_gate=True,
                         moe_aux_loss=_field(hf, "router_aux_loss_coef", float, 0.001),
                         moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                         pad_vocab_to=pad_vocab_to)
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse("activation_function", hf["activation_function"],
                    "is not supported (fastpar's GELU is the tanh approximation, gelu_new)")
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(field):
                _refuse(field, hf[field], "is not supported")
        if hf.get("tie_word_embeddings", True) is False:
            _refuse("tie_word_embeddings", False, "is not supported for GPT-2 (its head is tied)")
        d = _field(hf, "n_embd", int)
        return GPTConfig(vocab_size=_field(hf, "vocab_size", int),
                         n_layers=_field(hf, "n_layer", int), d_model=d,
                         n_heads=_field(hf, "n_head", int), d_ff=_field(hf, "n_inner", int, 4 * d),
                         max_seq_len=_field(hf, "n_positions", int), norm="layernorm",
                         activation="gelu", rotary=False, tie_embeddings=True, bias=True,
                         norm_eps=_field(hf, "layer_norm_epsilon", float, 1e-5),
                         pad_vocab_to=pad_vocab_to)
    raise ValueError(f"Hugging Face config: model_type={kind!r} is not supported (llama, gpt2, "
                     "mixtral, qwen2_moe)")


def _llama_like(hf: dict, rope_theta: float, eps: float) -> dict:
    """The GPTConfig fields of a Llama-family config (llama, mixtral, qwen2_moe) outside the MLP
    and the biases; ``rope_theta`` and ``eps``: the family's defaults."""
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "is not supported (the MLP is SwiGLU: silu)")
    if hf.get("rope_scaling"):
        _refuse("rope_scaling", hf["rope_scaling"], "is not supported (plain rotary only)")
    d, heads = _field(hf, "hidden_size", int), _field(hf, "num_attention_heads", int)
    head_dim = _field(hf, "head_dim", int, d // heads)
    if head_dim * heads != d:
        _refuse("head_dim", head_dim, f"x num_attention_heads != hidden_size {d}")
    return dict(vocab_size=_field(hf, "vocab_size", int),
                n_layers=_field(hf, "num_hidden_layers", int), d_model=d, n_heads=heads,
                n_kv_heads=_field(hf, "num_key_value_heads", int, None),
                max_seq_len=_field(hf, "max_position_embeddings", int), norm="rmsnorm",
                activation="swiglu", rotary=True,
                rotary_base=_field(hf, "rope_theta", float, rope_theta),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                norm_eps=_field(hf, "rms_norm_eps", float, eps))


def config_to_hf(c: GPTConfig) -> dict:
    """The ``config.json`` of a GPTConfig (Llama-, GPT-2-, Mixtral- or Qwen2-MoE-shaped; others
    refused)."""
    if c.n_experts:
        return _moe_config_to_hf(c)
    if c.norm == "rmsnorm" and c.activation == "swiglu" and c.rotary:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "vocab_size": c.vocab_size, "num_hidden_layers": c.n_layers,
                "hidden_size": c.d_model, "num_attention_heads": c.n_heads,
                "num_key_value_heads": c.kv_heads, "intermediate_size": c.ffn_dim,
                "max_position_embeddings": c.max_seq_len, "rope_theta": c.rotary_base,
                "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
                "attention_bias": c.bias, "mlp_bias": c.bias, "hidden_act": "silu",
                "head_dim": c.head_dim, "torch_dtype": "float32"}
    if c.norm == "layernorm" and c.activation == "gelu" and not c.rotary and c.tie_embeddings \
            and c.bias:
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": c.vocab_size, "n_layer": c.n_layers, "n_embd": c.d_model,
                "n_head": c.n_heads, "n_inner": c.ffn_dim, "n_positions": c.max_seq_len,
                "layer_norm_epsilon": c.norm_eps, "activation_function": "gelu_new",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": True, "torch_dtype": "float32"}
    raise ValueError(f"GPTConfig(norm={c.norm!r}, activation={c.activation!r}, rotary={c.rotary}"
                     f", tie_embeddings={c.tie_embeddings}, bias={c.bias}) is neither "
                     "Llama-shaped nor GPT-2-shaped: no Hugging Face format to export it to")


def _moe_config_to_hf(c: GPTConfig) -> dict:
    """Mixtral's ``config.json`` (no shared experts, renormalised top-k, no biases) or
    Qwen2-MoE's (gated shared experts; ``bias``: its q, k, v biases); others refused."""
    llama = c.norm == "rmsnorm" and c.activation == "swiglu" and c.rotary
    common = {"vocab_size": c.vocab_size, "num_hidden_layers": c.n_layers,
              "hidden_size": c.d_model, "num_attention_heads": c.n_heads,
              "num_key_value_heads": c.kv_heads, "max_position_embeddings": c.max_seq_len,
              "rope_theta": c.rotary_base, "rms_norm_eps": c.norm_eps,
              "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu",
              "num_experts_per_tok": c.moe_top_k, "router_aux_loss_coef": c.moe_aux_loss,
              "torch_dtype": "float32"}
    if llama and not c.moe_shared_experts and c.moe_norm_topk and not c.bias:
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **common,
                "intermediate_size": c.expert_ffn, "num_local_experts": c.n_experts,
                "head_dim": c.head_dim, "sliding_window": None, "router_jitter_noise": 0.0}
    if llama and c.moe_shared_experts and c.moe_shared_gate:
        return {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **common,
                "intermediate_size": c.ffn_dim, "moe_intermediate_size": c.expert_ffn,
                "shared_expert_intermediate_size": c.moe_shared_experts * c.expert_ffn,
                "num_experts": c.n_experts, "norm_topk_prob": c.moe_norm_topk,
                "qkv_bias": c.bias, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": False, "sliding_window": None}
    raise ValueError(f"GPTConfig(n_experts={c.n_experts}, moe_shared_experts="
                     f"{c.moe_shared_experts}, moe_shared_gate={c.moe_shared_gate}, moe_norm_topk="
                     f"{c.moe_norm_topk}, bias={c.bias}, norm={c.norm!r}, rotary={c.rotary}) is "
                     "neither Mixtral-shaped (no shared experts, moe_norm_topk, no biases) nor "
                     "Qwen2-MoE-shaped (shared experts with moe_shared_gate), both rmsnorm and "
                     "rotary: no Hugging Face format to export it to")


def _hf_name(kind: str, name: str) -> tuple[str, str | None]:
    """The Hugging Face tensor holding fastpar tensor ``name``, and for GPT-2's c_attn the part."""
    if name in ("embed.weight", "norm.weight", "norm.bias", "head.weight", "pos_embed.weight"):
        llama = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "head.weight": "lm_head.weight"}
        gpt2 = {"embed.weight": "transformer.wte.weight", "pos_embed.weight":
                "transformer.wpe.weight", "norm.weight": "transformer.ln_f.weight",
                "norm.bias": "transformer.ln_f.bias"}
        return (llama if kind in _LLAMA_FAMILY else gpt2)[name], None
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    if kind in _LLAMA_FAMILY:
        inverse = {v: k for k, v in _LLAMA_LAYER.items()}
        return f"model.layers.{i}.{inverse[module]}.{leaf}", None
    if module in ("attn.q", "attn.k", "attn.v"):
        return f"transformer.h.{i}.attn.c_attn.{leaf}", module[-1]
    inverse = {v: k for k, v in _GPT2_LAYER.items()}
    return f"transformer.h.{i}.{inverse[module]}.{leaf}", None


class _Source(NamedTuple):
    """Where a fastpar tensor lives in a Hugging Face directory, and the shape it has there."""
    name: str               # the Hugging Face tensor
    part: str | None        # "q", "k" or "v" of GPT-2's fused c_attn, else None
    conv: bool              # a GPT-2 Conv1D weight, stored transposed: (in, out)
    offset: int             # where the part starts along c_attn's q|k|v dimension
    want: list[int]         # fastpar's global shape without the vocabulary padding
    shape: list[int]        # the stored tensor's shape the config needs (each piece's)
    pieces: tuple = ()      # stacked experts: the stored tensors, in the order of fastpar's rows
    #                         (its (E, R, C) tensor as (E*R, C)); ``name`` is the first


def _moe_names(kind: str, config: GPTConfig, i: str, rest: str) -> list[str]:
    """The stored tensors of fastpar's MoE tensor ``rest`` (``router.weight``,
    ``experts.gate_up``, ...) of layer ``i``: one, or the pieces of a stacked one in order."""
    block, gate, up, down = _MOE[kind]
    p = f"model.layers.{i}.{block}."
    experts = [f"{p}experts.{e}." for e in range(config.n_experts)]
    shared = f"{p}shared_expert."
    return {"router.weight": [p + "gate.weight"],
            "shared_gate": [p + "shared_expert_gate.weight"],
            "experts.gate_up": [f"{x}{n}.weight" for x in experts for n in (gate, up)],
            "experts.down": [f"{x}{down}.weight" for x in experts],
            "shared.gate_up": [f"{shared}{n}.weight" for n in ("gate_proj", "up_proj")],
            "shared.down": [f"{shared}down_proj.weight"]}[rest]


def hf_source(kind: str, config: GPTConfig, name: str, shape) -> _Source | None:
    """Where fastpar tensor ``name`` (global shape ``shape``) is stored in a Hugging Face
    directory of ``kind``; None for one the directory does not hold: a tied head (it is the
    embedding) or Qwen2-MoE's output-projection bias (fastpar's ``bias`` puts one there: zero).
    The one rule both :func:`load_hf` and :func:`fastpar.train.init_from.check_source` compare
    stored shapes by."""
    if name == "head.weight" and config.tie_embeddings or \
            kind == "qwen2_moe" and name.endswith(".attn.o.bias"):
        return None
    if kind in _MOE and name.startswith("layers.") and name.split(".")[2] == "mlp":
        _, i, _, rest = name.split(".", 3)
        names = _moe_names(kind, config, i, rest)
        if len(shape) == 2:                             # the router, the shared-expert gate
            return _Source(names[0], None, False, 0, list(shape), list(shape))
        rows = shape[1] * shape[0] // len(names)        # each piece's rows
        return _Source(names[0], None, False, 0, list(shape), [rows, shape[2]], tuple(names))
    src, part = _hf_name(kind, name)
    conv = kind == "gpt2" and any(c in src for c in _GPT2_CONV1D) and src.endswith("weight")
    want = list(shape)
    if name in ("embed.weight", "head.weight"):
        want[0] = config.vocab_size                 # stored without fastpar's padding
    if part is not None:                            # one of c_attn's q, k, v
        offset = "qkv".index(part) * config.d_model
        stored = [want[1], 3 * want[0]] if conv else [3 * want[0]]
    else:
        offset = 0
        stored = [want[1], want[0]] if conv and len(want) == 2 else want
    return _Source(src, part, conv, offset, want, stored)


def _read_json(file: Path):
    """A JSON file's content; unreadable or invalid JSON is one ValueError naming the file."""
    try:
        return json.loads(file.read_text())
    except OSError as e:
        raise ValueError(f"{file} cannot be read ({e.strerror})") from None
    except ValueError as e:         # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{file} is not valid JSON ({e})") from None


def _hf_json(path: Path) -> dict | None:
    """``config.json`` of ``path`` as a dict; None when there is none."""
    file = path / "config.json"
    if not file.is_file():
        return None
    hf = _read_json(file)
    if not isinstance(hf, dict):
        raise ValueError(f"{file} is not a JSON object")
    return hf


def hf_config(path: Path) -> tuple[dict, GPTConfig]:
    """A Hugging Face directory's ``config.json`` and its GPTConfig; errors name the file."""
    hf = _hf_json(path)
    if hf is None:
        raise ValueError(f"{path} has no config.json")
    try:
        return hf, config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None


def hf_index(path: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor -> shard file), or None for an unsharded directory."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return None
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                   for f in weight_map.values()):
        raise ValueError(f"{index} holds no weight_map (tensor name -> shard file)")
    return weight_map


def hf_shards(path: Path, weight_map: dict[str, str] | None) -> list[str]:
    """The safetensors files of a directory: those its index names, else every one there."""
    files = [p.name for p in sorted(path.glob("*.safetensors"))] if weight_map is None else \
        sorted(set(weight_map.values()))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    for f in files:
        if Path(f).name != f:           # a shard outside the directory is never read
            raise ValueError(f"{path}: the index names shard {f!r}, not a file name")
        if not (path / f).is_file():
            raise ValueError(f"{path}: shard {f} named by the index is missing")
    return files


class _Reader:
    """Lazy access to a directory's safetensors tensors, by name, through slices."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.where, self._open = {}, []
        for f in hf_shards(path, hf_index(path)):
            try:
                handle = safe_open(str(path / f), framework="pt")
            except Exception as e:          # a truncated or corrupt file
                raise ValueError(f"{path / f}: not a readable safetensors file ({e})") from None
            self._open.append(handle)
            self.where.update({k: handle for k in handle.keys()})

    def shape(self, name: str) -> list[int]:
        if name not in self.where:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        return list(self.where[name].get_slice(name).get_shape())

    def block(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None):
        """Rows [a, z) (and columns, if given) of a stored tensor: only those bytes are read."""
        sl = self.where[name].get_slice(name)
        return sl[rows[0]:rows[1]] if cols is None else sl[rows[0]:rows[1], cols[0]:cols[1]]


def _read_rows(reader: _Reader, source: _Source, dim, start: int, stop: int, r0: int,
               r1: int) -> torch.Tensor | None:
    """Rows [r0, r1) of this TP rank's tensor (split along ``dim`` at [start, stop)), as the
    directory stores it: the rows read, transposed back for GPT-2's Conv1D, the rows past
    the real vocabulary (fastpar's padding) left out; None when every row is padding."""
    g0, g1 = (start + r0, start + r1) if dim == 0 else (r0, r1)        # the global rows
    real = min(g1, source.want[0])
    if real <= g0:
        return None
    if source.pieces:       # experts g0 .. real - 1, whole (MoE is never split over TP)
        per = len(source.pieces) // source.want[0]
        return torch.cat([reader.block(n, (0, source.shape[0]), None)
                          for n in source.pieces[g0 * per:real * per]]).view(
            real - g0, *source.want[1:])
    rows, cols = (source.offset + g0, source.offset + real), (start, stop) if dim == 1 else None
    if source.conv and len(source.want) == 2:      # stored (in, out): fastpar's rows are columns
        return reader.block(source.name, cols or (0, source.shape[0]), rows).t()
    return reader.block(source.name, rows, cols)


def _sources(path: Path, modules, tp_size: int, tp_rank: int):
    """(config, reader, [(name, spec, source)]) for the tensors of ``modules``, source None for
    one the directory does not hold (zero); a stored shape the config does not expect raises
    naming the tensor."""
    hf, config = hf_config(path)
    kind, reader = hf["model_type"], _Reader(path)
    out = []
    for name, spec in shard_specs(modules, tp_size, tp_rank).items():
        source = hf_source(kind, config, name, spec.shape)
        for stored_name in () if source is None else source.pieces or (source.name,):
            if stored_name not in reader.where:
                fused = next((k for k in reader.where if ".experts.gate_up_proj" in k), None)
                if fused:
                    raise ValueError(f"{path}: the experts are stored fused ({fused!r}, "
                                     "transformers 5's layout); fastpar reads one tensor per "
                                     f"expert and projection ({stored_name!r}), as "
                                     "transformers 4 writes them")
            stored = reader.shape(stored_name)
            if stored != source.shape:
                raise ValueError(f"{path}: tensor {stored_name!r} has shape {stored}, the config "
                                 f"needs {source.shape}")
        out.append((name, spec, source))
    return config, reader, out


@torch.no_grad()
def load_hf(path, modules, tp_size: int = 1, tp_rank: int = 0) -> GPTConfig:
    """Load the Hugging Face directory ``path`` into ``modules`` (this rank's GPT chunks, built
    with ``config_from_hf``'s config); returns that config. Each tensor is read as the slice
    this rank holds; a shape that does not match the config raises naming the tensor."""
    config, reader, found = _sources(Path(path), modules, tp_size, tp_rank)
    for _name, spec, source in found:
        t = spec.tensor
        x = None if source is None else \
            _read_rows(reader, source, spec.dim, spec.start, spec.stop, 0, t.shape[0])
        t.zero_()                                       # the vocabulary padding
        if x is not None:
            t.narrow(0, 0, x.shape[0]).copy_(x)
    for moe in moe_layers(modules):                     # Hugging Face's routers have no bias
        moe.router.bias.zero_()
    return config


class HFShardReader:
    """What ``DistributedOptimizer.load_shards`` reads a Hugging Face directory with (ZeRO-3
    over a model built on the meta device): a flat range of a parameter of ``modules`` (this
    rank's GPT chunks) comes from the rows of the stored tensors that range covers, and only
    those are read (a row: one output feature of a weight), so each rank reads about its
    1/dp. Build it before ``DataParallel`` (it notes each tensor by name); ``bytes_read``
    counts what it read."""

    def __init__(self, path, modules, tp_size: int = 1, tp_rank: int = 0):
        self.path, self.modules = Path(path), list(modules)
        self.config, self._reader, found = _sources(self.path, self.modules, tp_size, tp_rank)
        names = {id(p): (k, n) for k, m in enumerate(self.modules)
                 for n, p in m.named_parameters()}
        self._parts: dict[tuple[int, str], list] = {}   # (chunk, parameter name) -> its parts
        for _name, spec, source in found:
            off, rows = spec.rows or (0, spec.param.shape[0])
            parts = self._parts.setdefault(names[id(spec.param)], [])
            if source is not None:                      # else not stored: zero
                parts.append((off, rows, source, spec.dim, spec.start, spec.stop))
        self._where: dict[int, tuple[int, str]] | None = None
        self.bytes_read = 0

    def __call__(self, param, start: int, count: int) -> torch.Tensor:
        if self._where is None:         # the parameters now (DataParallel replaced meta ones)
            self._where = {id(p): (k, n) for k, m in enumerate(self.modules)
                           for n, p in m.named_parameters()}
        row = math.prod(param.shape[1:])
        r0, r1 = start // row, -(-(start + count) // row)
        out = torch.zeros((r1 - r0) * row)
        for off, rows, source, dim, s0, s1 in self._parts[self._where[id(param)]]:
            a, z = max(r0, off), min(r1, off + rows)
            x = _read_rows(self._reader, source, dim, s0, s1, a - off, z - off) \
                if a < z else None
            if x is not None:
                self.bytes_read += x.numel() * x.element_size()
                out[(a - r0) * row:(a - r0) * row + x.numel()] = x.reshape(-1)
        return out[start - r0 * row:start - r0 * row + count]


@torch.no_grad()
def hf_state_dict(model, kind: str | None = None) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a whole fastpar GPT (one process, tp=1), padding dropped. A
    value the format cannot hold (a router's loss-free bias, Qwen2-MoE's output-projection bias)
    must be zero, else it raises naming it."""
    kind = kind or config_to_hf(model.config)["model_type"]
    split = [n for n, m in model.named_modules() if getattr(m, "expert_slice", None)]
    if split:
        raise ValueError(f"{split[0]} holds experts {model.get_submodule(split[0]).expert_slice}"
                         f" of {model.config.n_experts} (expert parallelism): export the whole "
                         "model, e.g. with fastpar export from a checkpoint")
    for name, bias in model.named_buffers():
        if name.endswith("mlp.router.bias") and bias.any():
            raise ValueError(f"{name} (the loss-free bias, moe_bias_rate) is not zero; {kind}'s "
                             "router has none: the routing would change")
    out: dict[str, torch.Tensor] = {}
    for name, spec in shard_specs([model], 1, 0).items():
        source = hf_source(kind, model.config, name, spec.shape)
        if source is None:              # a tied head (the embedding), or a bias Qwen2-MoE lacks
            if name != "head.weight" and spec.tensor.any():
                raise ValueError(f"{name} is not zero, and {kind}'s checkpoint has no such "
                                 "tensor: it would be lost")
            continue
        x = spec.tensor.detach()[:source.want[0]]      # the vocabulary padding dropped
        if source.pieces:                               # stacked experts: one tensor each
            out.update(zip(source.pieces, (p.clone() for p in x.reshape(-1, x.shape[-1]).split(
                source.shape[0]))))
        elif source.part is not None:
            out.setdefault(source.name, {})[source.part] = x
        else:
            out[source.name] = (x.t() if source.conv else x).contiguous().clone()
    for src, parts in [(k, v) for k, v in out.items() if isinstance(v, dict)]:
        joined = torch.cat([parts[p] for p in "qkv"], 0)
        out[src] = (joined.t() if src.endswith("weight") else joined).contiguous().clone()
    return out


def save_hf(model, out) -> Path:
    """Write a whole fastpar GPT as a Hugging Face directory (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(model.config)
    tensors = hf_state_dict(model, config["model_type"])
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def is_hf_dir(path) -> bool:
    """Whether ``path`` is a Hugging Face directory (a config.json with a model_type), not a
    fastpar checkpoint (a manifest.json). A config.json that is not a JSON object raises."""
    hf = _hf_json(Path(path))
    return hf is not None and "model_type" in hf
