"""aiak's start-up hook for processes started by ``aiakrun`` (its folder leads PYTHONPATH).

With ``AIAK_AUTO=1`` it activates aiak (``aiak.launch._boot``); without, it only hands over to
the next ``sitecustomize`` on the path, which this one shadows. Nothing here imports torch.
A python that cannot import aiak (another interpreter than aiak's, first on PATH) stops at
once with a message naming it: running the script with every feature silently off would look
like success.
"""

import os

if os.environ.get("AIAK_AUTO") == "1":
    try:
        from aiak.launch import _boot
    except ImportError as e:
        import sys

        sys.stderr.write(
            f"aiak: AIAK_AUTO=1, but {sys.executable} cannot import aiak ({e}); run the "
            "python aiak is installed for (aiakrun --python, or its full path after '--')\n"
        )
        sys.stderr.flush()
        os._exit(1)  # SystemExit here would be a fatal error of site, not a clean exit
    _boot.boot()


def _chain() -> None:
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        path = os.path.join(folder, "sitecustomize.py")
        if folder == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_aiak_next_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


_chain()
del _chain
