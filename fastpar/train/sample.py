"""``fastpar generate``: text from a fastpar checkpoint or a Hugging Face directory.

    fastpar generate runs/x --prompt "def " --max-new-tokens 64 --temperature 0.8 --top-k 50
    torchrun --nproc-per-node 2 -m fastpar generate runs/x --prompt "def "    # tp=2
    fastpar generate runs/sft --chat --system "Answer briefly." --prompt "What is TP?"

CKPT is a checkpoint folder (``runs/x/checkpoints/step_N``), a run folder (its latest complete
checkpoint) or a Hugging Face directory. Under torchrun the ranks form one tensor-parallel group
(each loads its shards) and rank 0 prints. The tokenizer, unless ``--tokenizer`` names one: the
Hugging Face directory's tokenizer.json, or the one the run's training data was prepared with
(its ``config.json``), else bytes. Every check runs before any process group exists.

With ``--chat`` the prompt is a user message (after ``--system``'s system message), rendered with
the chat template beside the tokenizer's tokenizer.json (:func:`fastpar.data.tokenizer.
chat_template`) with the generation prompt, and only the reply is printed.
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
from ..data.tokenizer import (TOKENIZER_CONFIG, chat_template, load_tokenizer,
                              run_tokenizer_file, tokenizer_file, tokenizer_for_data)


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
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the tokenizer's chat "
                        f"template (the chat_template of the {TOKENIZER_CONFIG} beside its "
                        "tokenizer.json) and print only the reply")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message before the prompt")


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


def default_tokenizer_file(source: Path, hf: bool) -> Path | None:
    """The Hugging Face directory's tokenizer.json; for a fastpar checkpoint the one its run
    trained with (:func:`run_tokenizer_file`); None for bytes."""
    return tokenizer_file(source) if hf else run_tokenizer_file(source)


def default_tokenizer(source: Path, hf: bool):
    """The tokenizer of :func:`default_tokenizer_file`, else bytes."""
    return load_tokenizer(default_tokenizer_file(source, hf) or "bytes")


def prompt_ids(tok, tokenizer: str | Path, prompt: str, chat: bool = False,
               system: str | None = None) -> list[int]:
    """The ids generation continues: ``prompt``'s; with ``chat`` the rendering of ``prompt`` as
    a user message (after ``system`` as a system message) by the chat template of the tokenizer
    ``tokenizer`` (its tokenizer.json or folder), with the generation prompt."""
    if system is not None and not chat:
        raise ValueError("--system is for --chat only (the system message of a chat)")
    if not chat:
        return tok.encode(prompt)
    template = chat_template(tokenizer) if str(tokenizer) != "bytes" else None
    if template is None:
        raise ValueError(f"--chat needs a chat template, and the tokenizer {str(tokenizer)!r} "
                         "has none: pass --tokenizer a Hugging Face tokenizer folder whose "
                         f"{TOKENIZER_CONFIG} has chat_template")
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    return tok.encode(template.render(messages, add_generation_prompt=True))


def run_generate(args) -> int:
    from ..models.generate import check_generate

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        source, hf = resolve_source(args.checkpoint)
        config = source_config(source)
        config.check_tp(world)
        spec = args.tokenizer or default_tokenizer_file(source, hf) or "bytes"
        tok = load_tokenizer(spec)
        if tok.vocab_size < config.vocab_size:      # it could not decode what the model says
            raise ValueError(f"the tokenizer ({getattr(tok, 'name', tok)}) has a vocabulary of "
                             f"{tok.vocab_size}, the model {config.vocab_size}: pass the model's "
                             f"tokenizer with --tokenizer")
        ids = prompt_ids(tok, spec, args.prompt, args.chat, args.system)
        prompt = check_generate(config, ids, args.max_new_tokens, args.temperature, args.top_k)
        new = _generate(source, hf, config, prompt, args, world, tok.eos_id)
    except ValueError as e:
        if rank == 0:
            print(f"fastpar generate: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        if new and new[-1] == tok.eos_id:
            new = new[:-1]
        print(tok.decode(new if args.chat else prompt + new))
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
