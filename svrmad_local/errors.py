"""The base of errors that are the user's to fix (a bad path, a checkpoint we cannot load, a busy
folder): the CLI prints them as one line, not a traceback. ValueError and OSError are treated the
same way there."""


class UserError(Exception):
    pass
