"""The one exception type the compression package raises for bad tensors, bad options and bad bytes."""


class CodecError(ValueError):
    """A tensor a codec refuses to encode, an invalid codec option, or bytes a decoder refuses. One-line message."""
