"""Error types. Every user-facing failure is an EyasError whose message names the bad
value (file or flag) and the fix; the CLI turns it into one line and exit code 2."""


class EyasError(Exception):
    """Bad usage or bad input: the CLI prints the message on one line and exits 2."""

    exit_code = 2


class FindingsError(EyasError):
    """The command ran and found problems (doctor findings, failed gates): exit 1."""

    exit_code = 1
