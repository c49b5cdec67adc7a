"""Run one code block of the docs as a script, for tests/test_docs.py.

``python tests/_docs_runner.py CODE LABEL PRINTED`` runs the file CODE as ``__main__`` (as
``python CODE`` would, with the working directory first on ``sys.path``, not this folder) and
writes to PRINTED, as JSON, what each ``print`` call of the block printed, by its line number.
LABEL is the block's file name in tracebacks (``docs/padded.md:40``, or an included file's
path). Everything the block prints also goes to stdout as usual.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import sys


def main(code: str, label: str, printed_path: str) -> None:
    with open(code, encoding="utf-8") as f:
        source = f.read()
    printed: dict[int, list[str]] = {}
    plain_print = builtins.print

    def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
        if file is None or file is sys.stdout:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == label:
                text = io.StringIO()
                plain_print(*args, sep=sep, end=end, file=text)
                printed.setdefault(caller.f_lineno, []).append(text.getvalue())
        plain_print(*args, sep=sep, end=end, file=file, flush=flush)

    sys.argv = [label]
    sys.path[0] = os.getcwd()
    builtins.print = recording_print
    try:
        namespace = {"__name__": "__main__"}
        if os.path.isfile(label):  # an included file runs as that file
            namespace["__file__"] = label
        exec(compile(source, label, "exec"), namespace)
    finally:
        builtins.print = plain_print
        sys.stdout.flush()
        with open(printed_path, "w", encoding="utf-8") as f:
            json.dump(printed, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
