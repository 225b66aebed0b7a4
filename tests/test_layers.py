"""The layers are a rule, checked: every import inside trm goes from a higher layer to a lower one (or within
one), whether at the top of a module or inside a function.

    cli  ->  ops  ->  adapters  ->  core

``repo_manager/entry.py`` (the executable's front door, above the CLI: it answers an unchanged `trm sync`
before click is imported) and ``__main__.py`` are the only modules outside the four folders.

Triton's Python models (``adapters/triton/backends``, ``ops/llm/triton_models``) run inside Triton's stub,
possibly on a server without trm installed: they import nothing of trm at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "repo_manager"
LAYERS = {"core": 0, "adapters": 1, "ops": 2, "cli": 3}
STUB_MODELS = ("adapters/triton/backends", "ops/llm/triton_models", "ops/publish/huggingface/tokenizer_model.py")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "repo_manager":
                found += [(node.lineno, f"repo_manager.{alias.name}") for alias in node.names]
            elif node.module.startswith("repo_manager."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "repo_manager"]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_lives_in_a_layer_folder():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py", "entry.py")]
    assert not loose, f"modules outside the layer folders {sorted(LAYERS)}: {loose}"
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)


def test_imports_go_down_the_layers_only():
    wrong = []
    for path in MODULES:
        module = _module(path)
        if any(str(path.relative_to(PACKAGE)).startswith(stub) for stub in STUB_MODELS):
            continue
        own = _layer(module)
        for line, target in _imports(path):
            layer = _layer(target)
            if own is not None and layer is not None and layer > own:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({module.split('.')[1]}) imports {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("stub", STUB_MODELS)
def test_triton_python_models_import_nothing_of_trm(stub):
    files = [PACKAGE / stub] if (PACKAGE / stub).is_file() else list((PACKAGE / stub).rglob("*.py"))
    assert files, stub
    users = [f"{p.relative_to(PACKAGE.parent)}:{line}" for p in files for line, _ in _imports(p)]
    assert not users, users


def test_click_is_imported_by_the_cli_only():
    users = []
    for path in MODULES:
        if _module(path).startswith("repo_manager.cli"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "click" for n in names):
                users.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not users, users


def test_the_vllm_backend_knows_the_stored_form_of_model_json():
    """The backend runs in Triton's stub and cannot import trm: its copy of the placeholder trm stores in
    model.json's ``model`` (served from the version folder when a model.json arrives in that form) is the same."""
    from repo_manager.core.localized import PLACEHOLDER

    tree = ast.parse((PACKAGE / "adapters/triton/backends/vllm/model.py").read_text())
    values = [node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "STORED_FORM_PLACEHOLDER" for t in node.targets)]
    assert values == [PLACEHOLDER]


def test_no_import_cycles_not_even_type_only_ones():
    """Within a layer too, imports form no cycle, counting ``if TYPE_CHECKING:`` and in-function imports: a
    type two modules both need lives in the module that owns it (or a small module of its own)."""
    modules = {_module(path): path for path in MODULES}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("repo_manager"):
                # `from package import module` names the module; `from module import name`, the module
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[module] = {t for t in targets if t in modules and t != module}
    cycles, done = [], set()
    for start in sorted(graph):  # a cycle through `start` among the modules not examined yet
        stack, seen = [(start, (start,))], set()
        while stack:
            module, trail = stack.pop()
            for target in sorted(graph[module] - done):
                if target == start:
                    cycles.append(" -> ".join((*trail, start)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, (*trail, target)))
        done.add(start)
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_trm_agents_option_defaults_are_the_agents_own():
    """`trm agent`'s options show their defaults in --help; each is AgentOptions' default for that setting, so
    the command line and the API cannot drift apart."""
    import dataclasses

    from repo_manager.cli.commands.agent import agent_command
    from repo_manager.ops.agent import AgentOptions

    fields = {f.name: f.default for f in dataclasses.fields(AgentOptions)}
    compared = 0
    for param in agent_command.params:
        name = next((n for n in (param.name, f"{param.name}_s") if n in fields), None)
        if name is None or not isinstance(param.default, int | float | str) or isinstance(param.default, bool):
            continue  # no default (click's UNSET, None) or a flag
        assert param.default == fields[name], (param.name, param.default, fields[name])
        compared += 1
    assert compared >= 8  # interval, jitter, max_unavailable, listen, drain grace and timeout, head timeout, ...
    from repo_manager.ops.agent.http import HEAD_TIMEOUT_S

    assert fields["head_timeout_s"] == HEAD_TIMEOUT_S  # the endpoint's own default


def test_the_facts_an_error_takes_are_the_facts_it_declares():
    """``TrmError``'s keywords besides hint and report are ``FACTS``, each set as an attribute: the two lists
    cannot drift apart."""
    import inspect

    from repo_manager.core.errors import FACTS, TrmError

    keywords = [name for name, p in inspect.signature(TrmError.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("hint", "report")]
    assert keywords == list(FACTS)
    error = TrmError("m", **{name: f"value of {name}" for name in FACTS})
    assert error.facts == {name: f"value of {name}" for name in FACTS}
    assert TrmError("m").facts == {}


def test_every_lint_exception_says_why():
    """A ``noqa`` for an import inside a function, a broad except or a private member is a decision: it carries
    its reason on the line (``# noqa: PLC0415 - why``), so a reader never has to guess whether it is one."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            marker = line.partition("# noqa:")[2]
            if marker and any(rule in marker for rule in ("PLC0415", "BLE001", "SLF001")) and " - " not in marker:
                bare.append(f"{path.relative_to(PACKAGE.parent)}:{number}")
    assert not bare, f"lint exceptions without a reason: {bare}"
