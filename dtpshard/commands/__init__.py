"""The command layer: every `dtpshard` command is a function here whose signature and docstring are
its flags and its help (cli.py's cyclopts App reads them; a dataclass parameter annotated
`Parameter(name="*")` gives its fields as flags). A command parses nothing itself and computes
nothing itself: it calls the library function that does the work, which returns a value, and
prints that value as text or one JSON object. No module below this package imports cyclopts.
"""

__all__: list[str] = []  # the commands are reached through cli.COMMANDS, one module each
