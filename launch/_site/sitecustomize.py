"""aiak's start-up hook for processes started by ``aiakrun`` (its folder leads PYTHONPATH).

With ``AIAK_AUTO=1`` it activates aiak (``aiak.launch._boot``); without, it only hands over to
the next ``sitecustomize`` on the path, which this one shadows. Nothing here imports torch.
"""

import os

if os.environ.get("AIAK_AUTO") == "1":
    from aiak.launch import _boot

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
