"""RoleHost: a role's recipe travels pickled on its own, and the worker unpickles it when it
builds the role, after its background imports, not when the plugin arrives (unpickling a
recipe imports the role's module, torch and transformers among its imports)."""

from __future__ import annotations

import pickle

from pipeline.roles.host import RoleHost
from resources.launcher import BackgroundImports

UNPICKLED: list[str] = []


class RecordedRecipe:
    """A recipe that notes each time it is unpickled."""

    def __init__(self, result: str):
        self.result = result

    def __setstate__(self, state):
        UNPICKLED.append(state["result"])
        self.__dict__.update(state)

    def __call__(self) -> str:
        return self.result


def test_a_role_recipe_is_unpickled_when_the_role_is_built_after_the_background_imports():
    host = RoleHost("reward", RecordedRecipe("built"), torch_threads=None)
    arrived = pickle.loads(pickle.dumps(host))   # as Dask sends a plugin to a worker
    assert UNPICKLED == [] and arrived.build is None
    imports = BackgroundImports(("json", "csv"))
    imports.setup(worker=None)                   # the thread a worker starts as it comes up
    assert arrived._build(imports) == "built"
    assert imports.done.is_set() and UNPICKLED == ["built"]
    assert arrived._build(imports) == "built" and UNPICKLED == ["built"]   # once
    assert host._build(None) == "built"          # the driver's own object never travelled
