"""The errors that describe a bad input, free of torch: the command line names them before it knows
whether the command needs anything heavy."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or inconsistent."""


class MappingError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""
