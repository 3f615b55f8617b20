"""The one checkpoint error, for training checkpoints (dcp.py) and Hugging Face checkpoints (hf.py) alike."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match what is asked of it (the model being trained, a
    name or shape); the one-line message names the file or tensor and the fix."""


__all__ = ["CheckpointError"]
