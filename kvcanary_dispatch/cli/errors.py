"""The command line's one error type."""


class CliError(Exception):
    """A run-time error reported as one line, exit status 2."""


def out_of_memory(err: BaseException) -> str | None:
    """What ran out, where ``err`` is an allocation that did not fit: ``"host memory
    (MemoryError)"``, or ``"memory (...)"`` with the first line of torch's allocator error (a
    GPU's ``OutOfMemoryError``, the CPU allocator's ``RuntimeError``); else ``None``."""
    import torch

    if isinstance(err, MemoryError):
        return "host memory (MemoryError)"
    if isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
    ):
        return f"memory ({str(err).strip().splitlines()[0]})"
    return None
