"""The trainer's own bad-input and environment error: the binary prints it as one `error:` line, exit 2."""


class TrainingError(RuntimeError):
    pass
