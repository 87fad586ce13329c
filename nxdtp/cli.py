"""``nxdtp-merge`` / ``python tools/merge_checkpoints.py``: merge or reshard a sharded nxdtp checkpoint.

    nxdtp-merge CKPT_DIR OUT_DIR [--tag T] [--format safetensors|bin] [--config CONFIG_JSON] [--no-optimizer]
                [--force] [--no-progress] [--no-verify]
        dense Hugging Face checkpoint (model.safetensors or pytorch_model.bin, plus config.json) in OUT_DIR;
        --config supplies the config of checkpoints saved from model.state_dict(), which record none; the optimizer
        state (plain or ZeRO-1, keyed by parameter name) goes beside it as the dense model's optimizer holds it
        (optimizer.safetensors + optimizer.json; nxdtp.checkpointing.load_dense_optimizer_state), unless --no-optimizer
    nxdtp-merge CKPT_DIR OUT_DIR --reshard N [--pad-to-multiple-of M] [--tag T] [--force] [--no-progress] [--no-verify]
        sharded nxdtp checkpoint at tensor parallel size N in OUT_DIR
    nxdtp-merge CKPT_DIR OUT_DIR --to dcp [--tag T] [--config CONFIG_JSON] [--force] [--no-progress] [--no-verify]
        torch.distributed.checkpoint directory: the dense model's tensors at the top level under its HF state_dict
        names, the optimizer state under 'optimizer' as torch's flattened optimizer state dict names it
        (nxdtp.checkpointing.dcp_export)
    nxdtp-merge DCP_DIR OUT_DIR --from-dcp [--config CONFIG_JSON] [--force] [--no-progress]
        dense Hugging Face checkpoint from a torch.distributed.checkpoint directory a native job (DTensor TP, FSDP2,
        TorchTitan's HF-named layout) or --to dcp wrote, with its optimizer state beside it as a dense merge writes it
        (nxdtp.checkpointing.dcp_import); the config (in DCP_DIR or --config) names the model class
    nxdtp-merge DCP_DIR OUT_DIR --from-dcp --reshard N [--pad-to-multiple-of M] [--config CONFIG_JSON] [--force]
        sharded nxdtp checkpoint at tensor parallel size N (optimizer, step and scheduler included) from such a DCP
        directory, each new rank's piece read from it in bounded slabs (nxdtp.converters.dcp)
    nxdtp-merge NXD_CKPT_DIR OUT_DIR --from-nxd --config CONFIG_JSON [--tag T] [--force]
        dense HF checkpoint from an NxD BERT, Llama, Mistral or Mixtral checkpoint (Mixtral's also expert parallel),
        which carries no spec; the config's model_type picks the family (nxdtp.converters.nxd)

CKPT_DIR is a checkpoint directory (with 'newest'; --tag picks another tag) or one complete tag directory in it (as
the training log prints it; --tag is then an error). Without --tag, the newest intact tag is read (a damaged one is
skipped with a warning). Every file read is checked against its recorded size and checksum unless --no-verify. A
successful run prints what it wrote on stdout. Bad input (missing or damaged files, incomplete tag, existing output
directory, bad arguments) exits with status 2 and one line on stderr; the output directory is then left as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import List, Optional

PROG = "nxdtp-merge"
EXIT_BAD_INPUT = 2


class _BadUsage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block; exit status 2 like argparse
        raise _BadUsage(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Merge a sharded nxdtp checkpoint into a dense Hugging Face checkpoint, "
                                            "or reshard it to another tensor parallel size.")
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR",
                        help="checkpoint directory (holds 'newest' and tags), or one complete tag directory in it")
    parser.add_argument("output_dir", metavar="OUT_DIR", help="output directory (created; must not be inside CKPT_DIR)")
    parser.add_argument("--tag", default=None, help="tag to read when CKPT_DIR is a checkpoint directory (default: the "
                                                    "newest complete one); with --from-nxd, a tag in a directory of "
                                                    "NxD trainer checkpoint tags")
    parser.add_argument("--reshard", type=int, default=None, metavar="N",
                        help="write a sharded checkpoint at tensor parallel size N instead of a dense one")
    parser.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="M",
                        help="with --reshard: pad the vocabulary to a multiple of M * N (the model's "
                             "make_vocab_size_divisible_by; default: as the source records it)")
    parser.add_argument("--to", choices=("hf", "dcp"), default="hf",
                        help="what to write: a dense Hugging Face directory (default), or a torch.distributed."
                             "checkpoint (DCP) directory that dcp.load reads into a dense, DTensor or FSDP2 model "
                             "and its optimizer")
    parser.add_argument("--format", choices=("safetensors", "bin"), default=None,
                        help="dense output format: model.safetensors (streamed) or pytorch_model.bin (holds the "
                             "whole model in memory)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="dense merge: write the model only, not the optimizer state beside it")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check the files read against the sizes and checksums the checkpoint "
                             "records (faster; a damaged file is then not detected)")
    parser.add_argument("--from-dcp", action="store_true",
                        help="CKPT_DIR is a torch.distributed.checkpoint directory: write the dense HF checkpoint")
    parser.add_argument("--from-nxd", action="store_true",
                        help="CKPT_DIR is an NxD checkpoint (tp_rank_XX_pp_rank_00/checkpoint.pt, or an NxD trainer "
                             "checkpoint with model/dp_rank_00_tp_rank_XX_pp_rank_00.pt, or with expert parallelism "
                             "model/dp_rank_00_ep_rank_XX_tp_rank_XX_pp_rank_00.pt); needs --config")
    parser.add_argument("--config", default=None, metavar="CONFIG_JSON",
                        help="the HF config.json to write to OUT_DIR (needed with --from-nxd, and for checkpoints "
                             "saved from model.state_dict(), which record no config)")
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _from_nxd(args) -> str:
    if args.config is None:
        raise _BadUsage("--from-nxd needs --config CONFIG_JSON (NxD checkpoints carry no config)")
    if args.reshard is not None or args.format not in (None, "safetensors"):
        raise _BadUsage("--from-nxd writes a dense safetensors checkpoint; it takes no --reshard or --format")
    from .converters.nxd import merge_nxd_checkpoint

    kwargs = {"force": args.force, "progress": not args.no_progress}
    if args.tag is not None:
        kwargs["tag"] = args.tag
    return merge_nxd_checkpoint(args.checkpoint_dir, args.config, args.output_dir, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; return the exit status (0, or 2 for bad input)."""
    try:
        args = _parser().parse_args(argv)
        progress = not args.no_progress
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            # dcp.load(..., no_dist=True) in a tool that is one process by design: not news, and not one line
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            if args.no_optimizer and (args.to == "dcp" or args.from_nxd or args.reshard is not None):
                raise _BadUsage("--no-optimizer applies to dense merges (without --to dcp, --from-nxd or --reshard)")
            if args.from_dcp:
                report = _from_dcp(args)
            elif args.to == "dcp":
                report = _to_dcp(args)
            elif args.from_nxd:
                report = f"wrote dense checkpoint {_from_nxd(args)}"
            elif args.reshard is not None:
                if args.format not in (None, "safetensors"):
                    raise _BadUsage("--format applies to dense merges; --reshard writes nxdtp's sharded format")
                from .checkpointing.merge import reshard

                result = reshard(args.checkpoint_dir, args.output_dir, args.reshard, tag=args.tag, force=args.force,
                                 progress=progress, pad_to_multiple_of=args.pad_to_multiple_of, config=args.config,
                                 verify=not args.no_verify)
                report = _resharded(args.output_dir, result)
            else:
                if args.pad_to_multiple_of is not None:
                    raise _BadUsage("--pad-to-multiple-of only applies with --reshard")
                from .checkpointing.merge import merge_and_name_source

                result, tag_dir = merge_and_name_source(
                    args.checkpoint_dir, args.output_dir, tag=args.tag, force=args.force,
                    output_format="pytorch_bin" if args.format == "bin" else "safetensors", progress=progress,
                    config=args.config, verify=not args.no_verify, optimizer=not args.no_optimizer)
                report = _merged(result, tag_dir)
    except (_BadUsage, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{PROG}: {report}")
    return 0


def _from_dcp(args) -> str:
    clashes = [flag for flag, used in (("--from-nxd", args.from_nxd), ("--to dcp", args.to == "dcp"),
                                       ("--tag", args.tag is not None), ("--format", args.format is not None),
                                       ("--no-optimizer", args.no_optimizer),
                                       ("--pad-to-multiple-of without --reshard",
                                        args.pad_to_multiple_of is not None and args.reshard is None))
               if used]
    if clashes:
        raise _BadUsage(f"--from-dcp takes no {', '.join(clashes)}: it writes the dense HF checkpoint, which "
                        "from_pretrained_sharded loads at any TP size, or with --reshard N an nxdtp checkpoint")
    if args.reshard is not None:
        if args.reshard < 1:
            raise _BadUsage(f"--reshard {args.reshard}: the tensor parallel size must be an integer >= 1")
        if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
            raise _BadUsage(f"--pad-to-multiple-of {args.pad_to_multiple_of} must be an integer >= 1")
        from .converters.dcp import import_dcp_resharded

        tag_dir = import_dcp_resharded(args.checkpoint_dir, args.output_dir, args.reshard, config=args.config,
                                       force=args.force, progress=not args.no_progress,
                                       pad_to_multiple_of=args.pad_to_multiple_of)
        return _resharded(args.output_dir, tag_dir, f"DCP checkpoint {args.checkpoint_dir}")
    from .checkpointing.dcp_import import import_dcp

    result = import_dcp(args.checkpoint_dir, args.output_dir, config=args.config, force=args.force,
                        progress=not args.no_progress)
    lines = [f"wrote dense checkpoint {result.output_dir}: {result.model_keys} model tensors"
             + (f", {result.optimizer_keys} optimizer entries in optimizer.safetensors / optimizer.json"
                if result.optimizer_keys else "") + f", from DCP checkpoint {args.checkpoint_dir}"]
    lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)


def _to_dcp(args) -> str:
    clashes = [flag for flag, used in (("--reshard", args.reshard is not None), ("--from-nxd", args.from_nxd),
                                       ("--pad-to-multiple-of", args.pad_to_multiple_of is not None),
                                       ("--format", args.format is not None)) if used]
    if clashes:
        raise _BadUsage(f"--to dcp takes no {', '.join(clashes)}: it writes one DCP directory of the dense model")
    from .checkpointing.dcp_export import export_dcp

    result = export_dcp(args.checkpoint_dir, args.output_dir, tag=args.tag, force=args.force,
                        progress=not args.no_progress, config=args.config, verify=not args.no_verify)
    lines = [f"wrote DCP checkpoint {result.output_dir}: {result.model_keys} model tensors"
             + (f", {result.optimizer_keys} optimizer entries under 'optimizer'" if result.optimizer_keys
                else ", no optimizer state")
             + f", {result.files} data files, from tag {os.path.basename(os.path.normpath(result.tag_dir))} "
               f"({result.tag_dir})"]
    lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)


def _merged(path: str, tag_dir: str) -> str:
    """What a merge wrote, read back from the output file."""
    if path.endswith(".safetensors"):
        from .checkpointing.safetensors_stream import SafetensorsFileReader

        count = len(SafetensorsFileReader(path).keys())
    else:
        import torch

        count = len(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    config = os.path.join(os.path.dirname(path), "config.json")
    optimizer = os.path.join(os.path.dirname(path), "optimizer.safetensors")
    beside = [name for name, present in (("config.json", os.path.isfile(config)),
                                         ("the optimizer state in optimizer.safetensors", os.path.isfile(optimizer)))
              if present]
    return (f"wrote dense checkpoint {path} ({count} tensors{', with ' + ' and '.join(beside) if beside else ''}"
            f") from tag {os.path.basename(os.path.normpath(tag_dir))} ({tag_dir})")


def _resharded(output_dir: str, tag_dir: str, source: Optional[str] = None) -> str:
    """What a reshard wrote, read back from its index and reshard.json; ``source`` replaces the source it records."""
    from .checkpointing.index import CheckpointIndex

    index = CheckpointIndex.read(tag_dir)
    with open(os.path.join(tag_dir, "reshard.json")) as f:
        record = json.load(f)
    tp = index.tensor_model_parallel_size
    files = sorted(os.path.relpath(os.path.join(root, name), tag_dir)
                   for root, _, names in os.walk(tag_dir) for name in names)
    model_files = sum(1 for f in files if f.startswith("model" + os.sep))
    optim_files = sum(1 for f in files if f.startswith("optim" + os.sep) and f.endswith(".safetensors"))
    lines = [f"wrote checkpoint {output_dir}: tag {os.path.basename(tag_dir)} at tensor_model_parallel_size={tp} "
             f"(from {source or str(record['source_tensor_model_parallel_size']) + ', ' + record['source']}), "
             f"{len(index.tensors)} model "
             f"tensors in {model_files} model files, "
             + (f"optimizer state in {optim_files} files" if index.optimizer is not None else "no optimizer state")
             + f", vocabulary padded to a multiple of {record['pad_to_multiple_of']} * {tp}; {len(files)} files"]
    lines += [f"  note: {note}" for note in record.get("notes", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
