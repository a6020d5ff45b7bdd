"""The project's modules import each other without cycles (module-level and function-local imports
alike, and a package's __init__ counts as imported by its submodules' importers), so every module
can be read, imported and tested on its own; the graph comes from research/legibility.py."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _legibility():
    spec = importlib.util.spec_from_file_location("legibility", ROOT / "research" / "legibility.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_in_tasks_flows_schemas():
    leg = _legibility()
    found = leg.modules()
    graph = leg.with_package_inits(leg.import_graph(found))
    assert {"flows.main", "flows.train", "tasks.grpo.loss", "schemas.config"} <= set(graph)
    assert "schemas.config" in graph["flows.runtime"]  # edges are found
    assert leg.cycles(graph) == [], "import cycles (each a strongly connected set of modules)"


def test_the_cycle_finder_finds_cycles():
    leg = _legibility()
    assert leg.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert leg.cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    assert sorted(leg.cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == [["a", "b"], ["c", "d"]]
