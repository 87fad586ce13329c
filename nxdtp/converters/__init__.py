"""Converters between nxdtp's checkpoints and other formats, above nxdtp.models and nxdtp.checkpointing (they need a
model family's layout and the checkpoint writers): ``nxdtp.converters.nxd`` imports NxD checkpoints;
``nxdtp.converters.dcp`` imports a torch.distributed.checkpoint directory as an nxdtp checkpoint at any TP size."""
