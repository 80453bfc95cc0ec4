"""The learner's program: the definitions in a notebook's code cells, ready to load in a fresh process.

Grading never trusts the process the notebook ran in.  From the cells' source it keeps, in
order, only what defines things — imports, ``def`` and ``class`` (kernels included: a
``@cuda.jit`` or ``@triton.jit`` function is a ``def``), and assignments to plain names
(``BLOCK_M = 16``) — and drops every other statement: calls such as ``check(...)``, prints,
loops, and assignments into other objects (``module.attr = ...``, the way code would patch
the grader).  ``load`` runs that program in a fresh namespace from a real file, so that
``inspect.getsource`` (which ``triton.jit`` needs) finds the kernels' source.
"""
from __future__ import annotations

import ast
import linecache
import os
import sys
import tempfile
import types

#: the module name the learner's program is loaded under
MODULE = "learner_notebook"

_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _parse(cell: str):
    """The cell's module AST, with IPython's ``%magic`` / ``!shell`` lines dropped (None if it does not parse)."""
    for source in (cell, "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                   for line in cell.splitlines())):
        try:
            return ast.parse(source)
        except SyntaxError:
            continue
    return None


def _kept(node) -> bool:
    if isinstance(node, _KEPT):
        return True
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.value is not None
    return False


def extract(cells) -> str:
    """The definitions of ``cells`` (code cells' sources, in order) as one program."""
    parts = []
    for i, cell in enumerate(cells):
        tree = _parse(cell or "")
        if tree is None:
            continue
        lines = cell.splitlines()
        for node in tree.body:
            if _kept(node):
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                parts.append(f"# cell {i}, line {start}\n" + "\n".join(lines[start - 1: node.end_lineno]))
    return "\n\n".join(parts) + "\n"


def defines(program: str, name: str) -> bool:
    """Whether ``program`` binds ``name`` at the top level."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                  for a in node.names):
            return True
    return False


def notebook_cells(nb) -> list[str]:
    """The code cells' sources of an ``nbformat`` notebook, in order."""
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def load(program: str, folder: str | None = None) -> tuple[dict, str]:
    """Run ``program`` in a fresh namespace; returns ``(namespace, filename)``.

    The source is written to a file (and put in ``linecache``) so that tracebacks, ``inspect``
    and Triton see it.  A ``def`` or ``class`` that raises propagates; an import or assignment
    that raises is skipped with a printed note.
    """
    folder = folder or tempfile.mkdtemp(prefix="fa_lab_program_")
    filename = os.path.join(folder, "learner_notebook.py")
    with open(filename, "w", encoding="utf-8") as f:
        f.write(program)
    linecache.cache[filename] = (len(program), None, program.splitlines(True), filename)
    module = types.ModuleType(MODULE)     # a real module: Triton and Numba look kernels' globals up through it
    module.__file__ = filename
    sys.modules[MODULE] = module
    # statement by statement: an import or an assignment that fails (a demo line such as
    # `o = my_kernel(q, k, v)` whose inputs were made in a dropped loop) is skipped and said, so
    # that one line cannot cost every exercise of the notebook; a def that fails is an error
    for node in ast.parse(program, filename).body:
        code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
        try:
            exec(code, module.__dict__)  # noqa: S102 — the learner's definitions, in a child process
        except Exception as exc:  # noqa: BLE001
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                raise
            print(f"(grading) skipped line {node.lineno} of your definitions, it raised "
                  f"{type(exc).__name__}: {exc}")
    return module.__dict__, filename
