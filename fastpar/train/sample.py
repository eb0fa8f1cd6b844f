"""``fastpar generate``: text from a fastpar checkpoint or a Hugging Face directory.

    fastpar generate runs/x --prompt "def " --max-new-tokens 64 --temperature 0.8 --top-k 50
    torchrun --nproc-per-node 2 -m fastpar generate runs/x --prompt "def "    # tp=2

CKPT is a checkpoint folder (``runs/x/checkpoints/step_N``), a run folder (its latest complete
checkpoint) or a Hugging Face directory. Under torchrun the ranks form one tensor-parallel group
(each loads its shards) and rank 0 prints. The tokenizer, unless ``--tokenizer`` names one: the
Hugging Face directory's tokenizer.json, or the one the run's training data was prepared with
(its ``config.json``), else bytes. Every check runs before any process group exists.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..models.hf import is_hf_dir, load_hf
from .init_from import source_config
from .checkpoint import latest_checkpoint
from ..data.tokenizer import load_tokenizer, run_tokenizer_file, tokenizer_file, tokenizer_for_data


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint",
                       description="Continue a prompt with a fastpar checkpoint (of any layout) "
                                   "or a Hugging Face directory, on one process or on the "
                                   "tensor-parallel ranks of a torchrun job.")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint folder (runs/.../checkpoints/step_N), a run folder (its "
                        "latest checkpoint) or a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the K most likely tokens only (0 or unset = all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tokenizer", default=None,
                   help="'bytes', a tokenizer.json or a folder holding one (default: the "
                        "checkpoint's, see `fastpar generate --help`)")


def resolve_source(spec: str) -> tuple[Path, bool]:
    """(the folder to load, whether it is a Hugging Face directory) for CKPT."""
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"{spec} is not a folder")
    if is_hf_dir(path):
        return path, True
    if (path / "manifest.json").exists():
        return path, False
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found, False
    raise ValueError(f"{spec} is neither a Hugging Face directory (config.json with a "
                     f"model_type), a fastpar checkpoint (manifest.json), nor a run folder with "
                     f"a complete checkpoint in checkpoints/")


def default_tokenizer(source: Path, hf: bool):
    """The Hugging Face directory's tokenizer.json; for a fastpar checkpoint the one its run
    trained with (:func:`run_tokenizer_file`); else bytes."""
    if hf:
        return load_tokenizer(source if tokenizer_file(source) else "bytes")
    return load_tokenizer(run_tokenizer_file(source) or "bytes")


def run_generate(args) -> int:
    from ..models.generate import check_generate

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        source, hf = resolve_source(args.checkpoint)
        config = source_config(source)
        config.check_tp(world)
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer(source, hf)
        if tok.vocab_size < config.vocab_size:      # it could not decode what the model says
            raise ValueError(f"the tokenizer ({getattr(tok, 'name', tok)}) has a vocabulary of "
                             f"{tok.vocab_size}, the model {config.vocab_size}: pass the model's "
                             f"tokenizer with --tokenizer")
        prompt = check_generate(config, tok.encode(args.prompt), args.max_new_tokens,
                                args.temperature, args.top_k)
        new = _generate(source, hf, config, prompt, args, world, tok.eos_id)
    except ValueError as e:
        if rank == 0:
            print(f"fastpar generate: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        if new and new[-1] == tok.eos_id:
            new = new[:-1]
        print(tok.decode(prompt + new))
    return 0


def _generate(source: Path, hf: bool, config, prompt: list[int], args, world: int,
              eos_id) -> list[int]:
    """Build the model on this rank (a TP group of the whole job when world > 1), load its
    weights, and generate."""
    import fastpar
    from ..models import GPT, generate
    from .checkpoint import load_checkpoint

    if world > 1:
        mesh = fastpar.init(tp=world, pp=1, dp=1)
        group, device, tp_rank = mesh.tp_group, mesh.device, mesh.tp_rank
    else:       # one process: no process group needed
        mesh, group, tp_rank = None, None, 0
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GPT(config, tp_group=group, device=device).eval()
    if hf:
        load_hf(source, [model], world, tp_rank)
    else:
        load_checkpoint(source, [model], None, mesh)
    return generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                    args.seed, eos_id)


def print_sample(cfg, chunks, mesh, tokens, say) -> None:
    """After training: ``cfg.sample_tokens`` tokens the model writes after the first 16 tokens of
    ``tokens`` (temperature 0.8, top-k 40, seeded), printed by rank 0. Runs on the first
    data-parallel replica's TP group; a pipeline or sequence-parallel layout prints where to
    generate from instead (``fastpar generate`` loads its checkpoint on any TP layout), as does
    an expert-parallel one (its other ranks would have to dispatch with it)."""
    from ..models import generate

    ep = getattr(mesh, "ep_group", None) is not None and dist.get_world_size(mesh.ep_group) > 1
    if mesh.pp_size > 1 or cfg.sequence_parallel or mesh.cp_size > 1 or ep:
        kind = "pipeline" if mesh.pp_size > 1 else "context-parallel" if mesh.cp_size > 1 else \
            "expert-parallel" if ep else "sequence-parallel"
        if say:
            say(f"fastpar train: sample: `fastpar generate {cfg.out} --prompt TEXT` (a"
                f"{'n' * (kind[0] == 'e')} {kind} layout does not sample in training)")
        return
    if mesh.dp_rank != 0:
        return
    try:
        tok = tokenizer_for_data(cfg.data)
    except ValueError as e:     # ids without a tokenizer.json to decode them
        if say:
            say(f"fastpar train: no sample: {e}")
        return
    if tok.vocab_size < chunks[0].config.vocab_size:
        if say:
            say(f"fastpar train: no sample: the data's tokenizer ({tok.name}"
                f", vocabulary {tok.vocab_size}) cannot decode all of the model's "
                f"{chunks[0].config.vocab_size} ids")
        return
    prompt = [int(t) for t in tokens[:16]]
    n = min(cfg.sample_tokens, chunks[0].config.max_seq_len - len(prompt))
    with cfg.train_context(mesh.device.type):
        new = generate(chunks[0], prompt, n, temperature=0.8, top_k=40, seed=cfg.seed)
    if say:
        say(f"fastpar train: sample ({n} tokens after a held-out prompt):\n"
            f"{tok.decode(prompt)}\033[1m{tok.decode(new)}\033[0m" if _tty() else
            f"fastpar train: sample ({n} tokens after a held-out prompt, after the '|'):\n"
            f"{tok.decode(prompt)}|{tok.decode(new)}")


def _tty() -> bool:
    return sys.stdout.isatty()
