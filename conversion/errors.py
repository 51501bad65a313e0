"""The errors that describe a bad input, free of torch: the command line names them before it knows
whether the command needs anything heavy. `one_line` is how any message reaches the user."""

import re


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or inconsistent."""


class MappingError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""


# the longest message shown: a name or value a checkpoint supplies can be any length
MAX_MESSAGE_CHARS = 1000
# control characters (a newline in a tensor name would start a line of its own on the terminal), as escapes
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` as one line a terminal shows as it is: control characters written as escapes (`\\n`,
    `\\x1b`), and at most `limit` characters (the rest replaced by how many there were)."""
    text = _CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), str(message))
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text
