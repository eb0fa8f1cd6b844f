"""Hugging Face checkpoints in and out: Llama (``LlamaForCausalLM``) and GPT-2 (``GPT2LMHeadModel``).

A Hugging Face directory holds ``config.json`` and ``*.safetensors`` (one file, or shards named by
``model.safetensors.index.json``). :func:`config_from_hf` maps its config onto a
:class:`GPTConfig` (or refuses, naming the field fastpar cannot represent); :func:`load_hf`
fills a GPT chunk of any (tp, pp) layout, each rank reading only the rows or columns it holds
(safetensors slices, no full copy); the padded vocabulary rows are zero. :func:`hf_state_dict`
and :func:`save_hf` go back: full tensors of a whole model, the padding dropped.

The names follow the checkpoint's (:func:`fastpar.train.checkpoint.shard_specs`: ``attn.q``, ``mlp.gate``,
...), one rule per family. GPT-2's Conv1D weights are stored transposed ((in, out)) and its q, k,
v live in one ``c_attn``: they are transposed and cut on the way in and joined on the way out.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..models.config import GPTConfig

_LLAMA_LAYER = {"self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k",
                "self_attn.v_proj": "attn.v", "self_attn.o_proj": "attn.o",
                "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
                "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
_GPT2_LAYER = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_proj": "attn.o", "mlp.c_fc": "mlp.up",
               "mlp.c_proj": "mlp.down"}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _refuse(field: str, value, why: str):
    raise ValueError(f"Hugging Face config: {field}={value!r} {why}")


def config_from_hf(hf: dict, pad_vocab_to: int = 128) -> GPTConfig:
    """The GPTConfig of a Hugging Face ``config.json`` (as a dict); one error naming the field
    for what fastpar cannot represent."""
    kind = hf.get("model_type")
    if kind == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            _refuse("hidden_act", hf["hidden_act"], "is not supported (Llama's MLP is SwiGLU)")
        if hf.get("rope_scaling"):
            _refuse("rope_scaling", hf["rope_scaling"], "is not supported (plain rotary only)")
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            _refuse("attention_bias", hf.get("attention_bias"), "must equal mlp_bias "
                    f"({hf.get('mlp_bias')!r}): fastpar's layers have biases everywhere or nowhere")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            _refuse("head_dim", head_dim, f"x num_attention_heads != hidden_size "
                    f"{hf['hidden_size']}")
        return GPTConfig(vocab_size=hf["vocab_size"], n_layers=hf["num_hidden_layers"],
                         d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                         n_kv_heads=hf.get("num_key_value_heads"), d_ff=hf["intermediate_size"],
                         max_seq_len=hf["max_position_embeddings"], norm="rmsnorm",
                         activation="swiglu", rotary=True,
                         rotary_base=float(hf.get("rope_theta", 10000.0)),
                         tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                         bias=bool(hf.get("attention_bias", False)),
                         norm_eps=float(hf.get("rms_norm_eps", 1e-6)), pad_vocab_to=pad_vocab_to)
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse("activation_function", hf["activation_function"],
                    "is not supported (fastpar's GELU is the tanh approximation, gelu_new)")
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(field):
                _refuse(field, hf[field], "is not supported")
        if hf.get("tie_word_embeddings", True) is False:
            _refuse("tie_word_embeddings", False, "is not supported for GPT-2 (its head is tied)")
        return GPTConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=hf["n_embd"],
                         n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
                         max_seq_len=hf["n_positions"], norm="layernorm", activation="gelu",
                         rotary=False, tie_embeddings=True, bias=True,
                         norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                         pad_vocab_to=pad_vocab_to)
    raise ValueError(f"Hugging Face config: model_type={kind!r} is not supported (llama, gpt2)")


def config_to_hf(c: GPTConfig) -> dict:
    """The ``config.json`` of a GPTConfig (Llama-shaped or GPT-2-shaped; others refused)."""
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


def _hf_name(kind: str, name: str) -> tuple[str, str | None]:
    """The Hugging Face tensor holding fastpar tensor ``name``, and for GPT-2's c_attn the part."""
    if name in ("embed.weight", "norm.weight", "norm.bias", "head.weight", "pos_embed.weight"):
        llama = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "head.weight": "lm_head.weight"}
        gpt2 = {"embed.weight": "transformer.wte.weight", "pos_embed.weight":
                "transformer.wpe.weight", "norm.weight": "transformer.ln_f.weight",
                "norm.bias": "transformer.ln_f.bias"}
        return (llama if kind == "llama" else gpt2)[name], None
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    if kind == "llama":
        inverse = {v: k for k, v in _LLAMA_LAYER.items()}
        return f"model.layers.{i}.{inverse[module]}.{leaf}", None
    if module in ("attn.q", "attn.k", "attn.v"):
        return f"transformer.h.{i}.attn.c_attn.{leaf}", module[-1]
    inverse = {v: k for k, v in _GPT2_LAYER.items()}
    return f"transformer.h.{i}.{inverse[module]}.{leaf}", None


class _Reader:
    """Lazy access to a directory's safetensors tensors, by name, through slices."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(path.glob("*.safetensors"))]
        if not files:
            raise ValueError(f"{path}: no *.safetensors file")
        self.where, self._open = {}, []
        for f in files:
            if not (path / f).exists():
                raise ValueError(f"{path}: shard {f} named by the index is missing")
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

    def rows(self, name: str, dim: int | None, lo: int, hi: int) -> torch.Tensor:
        sl = self.where[name].get_slice(name)
        if dim is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


@torch.no_grad()
def load_hf(path, modules, tp_size: int = 1, tp_rank: int = 0) -> GPTConfig:
    """Load the Hugging Face directory ``path`` into ``modules`` (this rank's GPT chunks, built
    with ``config_from_hf``'s config); returns that config. Each tensor is read as the slice
    this rank holds; a shape that does not match the config raises naming the tensor."""
    from .checkpoint import shard_specs

    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    config, kind, reader = config_from_hf(hf), hf["model_type"], _Reader(path)
    for name, (t, shape, dim, start, stop, _p, _rows) in shard_specs(modules, tp_size,
                                                                      tp_rank).items():
        if name == "head.weight" and config.tie_embeddings:
            continue
        src, part = _hf_name(kind, name)
        stored = reader.shape(src)
        conv = kind == "gpt2" and any(c in src for c in _GPT2_CONV1D) and src.endswith("weight")
        want = list(shape)
        if name in ("embed.weight", "head.weight"):
            want[0] = config.vocab_size                 # stored without fastpar's padding
        if part is not None:                            # one of c_attn's q, k, v
            off = "qkv".index(part) * config.d_model
            want_src = [want[1], 3 * want[0]] if conv else [3 * want[0]]
        else:
            off = 0
            want_src = [want[1], want[0]] if conv and len(want) == 2 else want
        if stored != want_src:
            raise ValueError(f"{path}: tensor {src!r} has shape {stored}, the config needs "
                             f"{want_src}")
        d = 0 if dim is None else dim
        lo, hi = (start, stop) if dim is not None else (0, shape[d])
        hi_real = min(hi, want[d])                      # padded vocabulary rows are zero
        if conv or part is not None:
            src_dim = (1 - d) if conv and len(want) == 2 else d
            x = reader.rows(src, src_dim, off + lo, off + hi_real) if hi_real > lo else None
            x = x.t() if x is not None and conv and len(want) == 2 else x
        else:
            x = reader.rows(src, d if dim is not None or hi_real < hi else None, lo, hi_real) \
                if hi_real > lo else None
        t.zero_()
        if x is not None:
            t.narrow(d, 0, hi_real - lo).copy_(x)
    return config


@torch.no_grad()
def hf_state_dict(model, kind: str | None = None) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a whole fastpar GPT (one process, tp=1), padding dropped."""
    from .checkpoint import shard_specs

    c = model.config
    kind = kind or config_to_hf(c)["model_type"]
    out: dict[str, torch.Tensor] = {}
    for name, (t, *_rest) in shard_specs([model], 1, 0).items():
        src, part = _hf_name(kind, name)
        x = t.detach()
        if name in ("embed.weight", "head.weight"):
            x = x[:c.vocab_size]
        conv = kind == "gpt2" and any(m in src for m in _GPT2_CONV1D) and src.endswith("weight")
        if part is not None:
            out.setdefault(src, {})[part] = x
            continue
        out[src] = (x.t() if conv else x).contiguous().clone()
    for src, parts in [(k, v) for k, v in out.items() if isinstance(v, dict)]:
        joined = torch.cat([parts[p] for p in "qkv"], 0)
        out[src] = (joined.t() if src.endswith("weight") else joined).contiguous().clone()
    if c.tie_embeddings and kind == "llama":
        out.pop("lm_head.weight", None)
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
    fastpar checkpoint (a manifest.json)."""
    config = Path(path) / "config.json"
    return config.exists() and "model_type" in json.loads(config.read_text())


def source_config(path) -> GPTConfig:
    """The model config of a Hugging Face directory or of a fastpar checkpoint."""
    path = Path(path)
    if is_hf_dir(path):
        return config_from_hf(json.loads((path / "config.json").read_text()))
    from .checkpoint import read_manifest

    if not (path / "manifest.json").exists():
        raise ValueError(f"{path} is neither a Hugging Face directory (config.json) nor a "
                         f"fastpar checkpoint (manifest.json)")
    return GPTConfig(**read_manifest(path)["model_config"])


def export_checkpoint(ckpt, out) -> Path:
    """A fastpar checkpoint of any layout as a Hugging Face directory (``fastpar export``)."""
    from ..models.gpt import GPT
    from .checkpoint import load_checkpoint
    from .tokenizer import run_tokenizer_file

    model = GPT(source_config(ckpt))
    load_checkpoint(ckpt, [model], None, None)
    out = save_hf(model, out)
    tok = run_tokenizer_file(ckpt)          # the tokenizer the run's data was prepared with
    if tok is not None:
        shutil.copyfile(tok, Path(out) / "tokenizer.json")
    return out
