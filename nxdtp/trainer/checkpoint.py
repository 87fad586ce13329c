"""NxD's trainer checkpoint functions (``neuronx_distributed.trainer.checkpoint``) over nxdtp's checkpoint format.

``save_checkpoint``, ``load_checkpoint``, ``has_checkpoint`` and ``finalize_checkpoint`` take NxD 2.29's parameters,
in NxD's order, with NxD's defaults. What they write is an ordinary nxdtp checkpoint tag (docs/checkpoints.md): the
same writer as ``nxdtp.checkpointing.save`` (``prepare_save`` + ``write_save``), so merging, resharding, integrity
checks, ``done``/``newest``, tag locks and kill -9 safety are those of every nxdtp checkpoint. The differences from
NxD's files and what each keyword does here are in docs/checkpoints.md ("NxD's trainer API").

Wrappers (NxD's ``NxDModel`` / ``NxDOptimizer`` and those of other libraries) are unwrapped by
``nxdtp.checkpointing.unwrap``'s rule, the one every checkpoint path follows.

Asynchronous saves (``async_save=True``): the call does, in the calling thread and on every rank, everything that is
collective (the tag lock, the replicated-tensor check, the tag directory) and takes a host copy of exactly the tensors
this rank writes, with the RNG states, scheduler state and ``user_content`` encoded or copied at that moment; then it
returns. A background thread writes the files; the exchanges the writing needs (every rank's failure or success, the
file records that rank 0 puts in the index) run over a gloo group of their own (``comm.new_host_group``, made once per
topology in the foreground), so they never meet the training loop's collectives on a shared group.
``finalize_checkpoint()`` waits for the writer and raises its error on every rank; the next ``save_checkpoint`` or
``load_checkpoint`` calls it first.
"""

from __future__ import annotations

import collections
import glob
import os
import threading
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .. import comm
from ..checkpointing import load, tags
from ..checkpointing.index import INDEX_FILE
from ..checkpointing.save_load import prepare_save, write_save
from ..checkpointing.unwrap import unwrap_model, unwrap_optimizer
from ..topology import get_topology

__all__ = ["save_checkpoint", "load_checkpoint", "has_checkpoint", "finalize_checkpoint"]

# The entry of nxdtp's checkpoint dict that holds user_content (stored with torch.save, read with weights_only=True).
USER_CONTENT_KEY = "user_content"


# ---- user_content ----------------------------------------------------------------------------------------------------

# What torch.load(weights_only=True) rebuilds (tests/test_trainer_checkpoint.py round-trips each): the only values
# user_content may hold, so that a save refuses what a load could not read.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)
USER_CONTENT_TYPES = ("None, bool, int, float, complex, str, bytes, bytearray, torch.Tensor (and nn.Parameter), "
                      "torch.Size, torch.dtype, torch.device, and dict, OrderedDict, list, tuple and set of these")


def check_user_content(value: Any, path: str = "user_content") -> None:
    """Raise ``TypeError`` naming the first value inside ``value`` (by its path) that ``torch.load(weights_only=True)``
    cannot rebuild; nxdtp reads pickles only that way, so such a value would be lost at load time."""
    kind = type(value)
    if kind in _LEAF_TYPES or kind in (torch.Tensor, nn.Parameter):
        return
    if kind in (dict, collections.OrderedDict):
        for key, item in value.items():
            check_user_content(key, f"a key of {path}")
            check_user_content(item, f"{path}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for i, item in enumerate(value):
            check_user_content(item, f"{path}[{i}]" if kind is not set else f"an element of {path}")
        return
    hint = ""
    if hasattr(value, "__dict__") and not callable(value) and not isinstance(value, torch.Tensor):
        hint = f" (vars({path}) gives its attributes as a dict)"
    elif isinstance(value, torch.Tensor):
        hint = " (a tensor subclass: pass torch.Tensor(x) or x.as_subclass(torch.Tensor))"
    elif type(value).__module__ == "numpy":
        hint = " (convert it: .item() for a scalar, torch.from_numpy(x) for an array)"
    raise TypeError(f"save_checkpoint(): {path} is a {kind.__module__}.{kind.__qualname__}, which nxdtp does not "
                    f"store: user_content is read back with torch.load(weights_only=True), which rebuilds only "
                    f"{USER_CONTENT_TYPES}{hint}")


# ---- arguments -------------------------------------------------------------------------------------------------------

def _check_bool(function: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{function}(): {name}={value!r} must be True or False")


def _check_num_workers(function: str, num_workers: Any) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"{function}(): num_workers={num_workers!r} must be a positive integer (NxD's range is 1-32; "
                         "nxdtp accepts any and does not use it: every writing rank streams its files)")


def _keep_last(num_kept_ckpts: Any) -> Optional[int]:
    """NxD's num_kept_ckpts as nxdtp's keep_last: None and -1 keep every tag."""
    if num_kept_ckpts is None or (type(num_kept_ckpts) is int and num_kept_ckpts == -1):
        return None
    if isinstance(num_kept_ckpts, bool) or not isinstance(num_kept_ckpts, int) or num_kept_ckpts < 1:
        raise ValueError(f"save_checkpoint(): num_kept_ckpts={num_kept_ckpts!r} must be None or -1 (keep every tag) "
                         "or a positive number of complete tags to keep (the one just written counts)")
    return num_kept_ckpts


def _tag(function: str, tag: Any) -> str:
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"{function}(): tag={tag!r} must be a string (or an integer, used as its decimal string)")
    return str(tag)


# ---- asynchronous saves ----------------------------------------------------------------------------------------------

class _BackgroundSave:
    """One save being written by a background thread."""

    def __init__(self, job, process_group):
        self.tag_dir = job.tag_dir
        self.error: Optional[BaseException] = None
        # Not a daemon: an interpreter that ends before finalize_checkpoint() waits for the files, as NxD's atexit
        # hook does.
        self.thread = threading.Thread(target=self._run, args=(job, process_group), daemon=False,
                                       name=f"nxdtp checkpoint writer {job.tag}")
        self.thread.start()

    def _run(self, job, process_group) -> None:
        try:
            with comm.host_group_of_this_thread(process_group):
                write_save(job)
        except BaseException as e:  # noqa: BLE001 - raised by finalize_checkpoint on the calling thread
            self.error = e


_PENDING: Optional[_BackgroundSave] = None
# (topology, gloo group of every rank) for background writers: made once per topology, in the foreground.
_WRITER_GROUP: Optional[Tuple[Any, Any]] = None


def _writer_group():
    global _WRITER_GROUP
    topology = get_topology()
    if _WRITER_GROUP is None or _WRITER_GROUP[0] is not topology:
        _WRITER_GROUP = (topology, comm.new_host_group())
    return _WRITER_GROUP[1]


def finalize_checkpoint() -> None:
    """Wait for the asynchronous save in flight, if any, and raise its error (on every rank: the rank that failed
    raises its own error, the others a ``RuntimeError`` naming it). Every rank must call it at the same point; the next
    ``save_checkpoint`` and ``load_checkpoint`` call it first. Nothing to do after synchronous saves."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return
    pending.thread.join()
    comm.raise_on_every_rank_if_any_failed(pending.error, f"saving {pending.tag_dir} in the background")


# ---- the four functions ----------------------------------------------------------------------------------------------

def save_checkpoint(checkpoint_dir_str, tag, model=None, optimizer=None, scheduler=None, user_content=None,
                    num_workers=8, use_xser=False, num_kept_ckpts=None, async_save=False, zero1_optimizer=False,
                    use_zero1_dcp=False, avoid_saving_lower_precision_weights=False) -> None:
    """Save ``model``, ``optimizer``, ``scheduler`` and ``user_content`` as tag ``tag`` of ``checkpoint_dir_str`` (NxD's
    call, positional form included); every rank calls it with the same arguments.

    The tag is an nxdtp checkpoint tag (``done`` last, ``newest`` replaced atomically, checksums, a lock while it is
    written). ``model`` is required (a module, a wrapper of one, or its state dict); ``optimizer`` may be an optimizer,
    a wrapper of one, a ``NeuronZero1Optimizer`` (every DP rank writes its shards, master weights included) or a state
    dict. ``user_content`` may hold only what ``torch.load(weights_only=True)`` rebuilds (``USER_CONTENT_TYPES``);
    anything else raises ``TypeError`` here, naming it. ``num_kept_ckpts`` keeps that many complete tags (None or -1:
    all). ``async_save=True`` returns once a host copy is taken (see the module docstring); ``finalize_checkpoint()``
    waits for it.

    Accepted and without effect here (nxdtp's format makes them moot; docs/checkpoints.md): ``num_workers``,
    ``use_xser``, ``zero1_optimizer`` (ZeRO-1 is recognised from the optimizer), ``use_zero1_dcp`` (ZeRO-1 state
    reloads at any DP size anyway) and ``avoid_saving_lower_precision_weights`` (the model file is always written;
    merge and reshard need it). NxD's refusal of ``use_zero1_dcp`` with ``avoid_saving_lower_precision_weights`` is
    kept.
    """
    tag = _tag("save_checkpoint", tag)
    _check_save_options(num_workers, use_xser, async_save, zero1_optimizer, use_zero1_dcp,
                        avoid_saving_lower_precision_weights)
    keep_last = _keep_last(num_kept_ckpts)
    model, optimizer = _checked_model(unwrap_model(model)), unwrap_optimizer(optimizer)
    finalize_checkpoint()  # one save at a time: the previous one is complete (or raised) before this one starts
    # user_content may differ between ranks: all learn whether any refused it, before the collectives below.
    error: Optional[BaseException] = None
    try:
        if user_content is not None:
            check_user_content(user_content)
    except TypeError as e:
        error = e
    checkpoint_dir = os.fspath(checkpoint_dir_str)
    comm.raise_on_every_rank_if_any_failed(error, f"saving {os.path.join(checkpoint_dir, tag)}")
    checkpoint = {key: value for key, value in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                                                (USER_CONTENT_KEY, user_content)) if value is not None}

    # Collective on every rank, before anything that can fail on one rank alone.
    group = _writer_group() if async_save else None
    job = prepare_save(checkpoint, checkpoint_dir, tag=tag, keep_last=keep_last,
                       pickled_keys=(USER_CONTENT_KEY,))
    if not async_save:
        write_save(job)
        return
    try:
        job.to_host()
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = e
    try:
        comm.raise_on_every_rank_if_any_failed(error, f"saving {job.tag_dir}")
    except BaseException:
        if job.lock is not None:
            job.lock.release()
        raise
    global _PENDING
    _PENDING = _BackgroundSave(job, group)


def _check_save_options(num_workers, use_xser, async_save, zero1_optimizer, use_zero1_dcp,
                        avoid_saving_lower_precision_weights) -> None:
    function = "save_checkpoint"
    _check_num_workers(function, num_workers)
    for name, value in (("use_xser", use_xser), ("async_save", async_save), ("zero1_optimizer", zero1_optimizer),
                        ("use_zero1_dcp", use_zero1_dcp),
                        ("avoid_saving_lower_precision_weights", avoid_saving_lower_precision_weights)):
        _check_bool(function, name, value)
    if use_zero1_dcp and avoid_saving_lower_precision_weights:
        raise ValueError("save_checkpoint(): use_zero1_dcp=True and avoid_saving_lower_precision_weights=True cannot "
                         "be combined (NxD refuses them together too)")


def _checked_model(model):
    if model is None:
        raise ValueError("save_checkpoint(): model=None: nxdtp checkpoints always hold the model (optimizer state is "
                         "keyed by its parameter names, and merge and reshard read the model files); pass the model")
    if not isinstance(model, (nn.Module, dict)):
        raise TypeError(f"save_checkpoint(): model must be an nn.Module (or a wrapper of one) or its state dict, got "
                        f"{type(model).__name__}")
    return model


def load_checkpoint(path, tag=None, model=None, optimizer=None, scheduler=None, num_workers=8, strict=True,
                    use_zero1_dcp=False) -> Any:
    """Load tag ``tag`` of ``path`` (None: the newest intact complete tag) into ``model``, ``optimizer`` and
    ``scheduler``; return the ``user_content`` saved with it (None when there was none). Every rank calls it.

    The model is loaded before the optimizer, and a ZeRO-1 optimizer takes its fp32 master shards from the checkpoint,
    so the resumed weights are the saved ones whatever the parameters' dtype. ``strict`` is passed to the model's
    ``load_state_dict``. ``num_workers`` and ``use_zero1_dcp`` are accepted and change nothing. RNG states are not
    restored (as in NxD); ``nxdtp.checkpointing.load(..., restore_rng_states=True)`` does that.
    """
    function = "load_checkpoint"
    _check_num_workers(function, num_workers)
    _check_bool(function, "strict", strict)
    _check_bool(function, "use_zero1_dcp", use_zero1_dcp)
    if tag is not None:
        tag = _tag(function, tag)
    model, optimizer = unwrap_model(model), unwrap_optimizer(optimizer)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"load_checkpoint(): model must be an nn.Module (or a wrapper of one), got "
                        f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"load_checkpoint(): optimizer must be a torch.optim.Optimizer (or a wrapper of one), got "
                        f"{type(optimizer).__name__}")
    finalize_checkpoint()  # a save of this job still being written must be complete before anything is read
    path = os.fspath(path)
    if not os.path.isdir(path):  # every rank sees the same directory: the same error on every rank, no collective
        raise FileNotFoundError(f"load_checkpoint(): checkpoint directory {path} does not exist")
    try:
        state = load(path, model=model, optimizer=optimizer, scheduler=scheduler, tag=tag, strict=strict)
    except Exception as e:
        nxd = _nxd_tags(path, tag)  # the files every rank sees: the same answer on every rank
        if nxd:
            raise ValueError(
                f"load_checkpoint(): {path} holds checkpoints of NxD's save_checkpoint (tags {nxd}, with "
                "model/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt files), which nxdtp does not load directly: convert the "
                f"model with nxdtp-merge {path} OUT_DIR --from-nxd --config CONFIG_JSON [--tag T] and build it with "
                "nxdtp.models.from_pretrained_sharded(OUT_DIR); NxD's optimizer and scheduler states are not "
                "converted") from e
        raise
    return state.get(USER_CONTENT_KEY)


def _nxd_tags(path: str, tag: Optional[str]) -> list:
    """Tags of ``path`` (or ``tag`` alone) laid out as NxD's ``save_checkpoint`` writes them, and not nxdtp tags."""
    names = [tag] if tag is not None else sorted(os.listdir(path))
    return [name for name in names if not os.path.isfile(os.path.join(path, name, INDEX_FILE))
            and glob.glob(os.path.join(glob.escape(path), glob.escape(name), "model", "dp_rank_*_tp_rank_*.pt"))]


def has_checkpoint(checkpoint_dir_str) -> bool:
    """Whether ``checkpoint_dir_str`` holds a complete tag (one with ``done``); False when the directory does not
    exist."""
    return len(tags.complete_tags(os.fspath(checkpoint_dir_str))) > 0
