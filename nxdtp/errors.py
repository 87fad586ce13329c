"""The base class of nxdtp's errors for damaged or malformed outside input (checkpoints, model directories), in a
module that imports nothing so that every layer can raise its own subclass.

Each reader raises its own named subclass, with the damaged file's name in the message; ``except DamagedInputError``
catches all of them, and, since it is a ``ValueError``, so does ``except ValueError`` as before.
"""


class DamagedInputError(ValueError):
    """Input from outside nxdtp (a file or directory) that cannot be read as what it claims to be: truncated, flipped
    bytes, a wrong structure, or a record that disagrees with the data. The message names the file and what is wrong."""
