"""The data package's one error type: bad data input, named by file, field and offset."""


class DataError(ValueError):
    """Bad data input: a missing or malformed `.bin`/`.idx`, a token id outside the vocabulary,
    a split too small for one sample, prebuilt indices that do not match the request, ...
    The message names the file (and sequence, offset or field) at fault."""
