"""Checkpoints and run folders: saving and loading with ``torch.distributed.checkpoint``, resharding at
another tensor-parallel size, the fingerprint and checks a resumed run must pass, save errors, and the
protected run folder."""
