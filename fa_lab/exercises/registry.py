"""What an exercise is, and where they are kept: ``Case``, ``Mistake``, ``Exercise``, the registry.

An exercise is a function the learner writes (``softmax_rows``, ``online_attention``,
...), a solution with the same signature, and a generator of test cases.  Each chapter's
modules (``fa_lab/exercises/chN.py`` for the warm-ups, ``chN_kernels.py`` for the kernel
exercises) build its exercises and register them on import; ``names``, ``get``,
``reference``, ``hint`` and ``describe`` load every chapter first.

Optional ``Exercise`` fields (all defaulted; chapters that do not need them ignore them):

``tile``          ``(BLOCK_M, BLOCK_N)`` or ``case -> (BLOCK_M, BLOCK_N)`` (None = not tiled along
                  that axis); ``case.meta['block_m'/'block_n']`` override it.  Used to say which
                  tile / program id the worst element belongs to.
``structure``     ``StructureCheck`` objects (see ``structure.py``): each is an extra row on the
                  cases it applies to (by default those with ``meta['structure']=True``).
``mistakes``      known wrong answers (``Mistake``): when the learner's output matches one,
                  the feedback names it.
``out_args``      kernel style: indices of positional arguments the function writes into.
                  They are poisoned (NaN) before the call and judged after it.
``outputs``       names of the results for messages, e.g. ``("o", "lse")``.
``judge_dtype``   e.g. ``torch.float64``: values are judged against the solution run on
                  inputs upcast to this dtype (the float64 reference is the judge), at the
                  tolerance of ``case.dtype``; the learner must still return the solution's dtypes.
``strict_dtype``  a float result in another float dtype is wrong (default True).
``poison_empty``  ``torch.empty``-style buffers come back filled with NaN (default True).
``kind``          ``"python"`` (PyTorch / NumPy code), ``"numba"`` or ``"triton"``: a kernel exercise's
                  check also scores, on every case, that the learner's function launched a kernel
                  of that kind written by the learner (not one of fa_lab's).
``hints``         hints in tiers, opened one at a time with ``hint(name, level)``: the first says
                  where to look and never states the answer; the last may spell it out.
``model_answer``  what a learner would write (a kernel exercise: a function that launches a
                  kernel); ``solution`` stays the judge.  Defaults to ``solution``.  ``fa-lab grade
                  --solutions`` and the tests grade the model answer, which must get full marks.

``Case.meta`` carries facts the feedback uses: ``n_q``, ``n_k``, ``causal``, ``window``,
``block_m``, ``block_n``, ``structure`` (and anything a chapter wants to label cases with).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: the chapters' modules in the book's order (a chapter's warm-ups, then its kernels); each registers
#: its exercises on import
CHAPTER_MODULES = [
    "fa_lab.exercises.ch1",
    "fa_lab.exercises.ch2",
    "fa_lab.exercises.ch3",
    "fa_lab.exercises.ch3_kernels",
    "fa_lab.exercises.ch3_occupancy",
    "fa_lab.exercises.ch4",
    "fa_lab.exercises.ch4_kernels",
    "fa_lab.exercises.ch5",
    "fa_lab.exercises.ch5_kernels",
    "fa_lab.exercises.ch5_split",
    "fa_lab.exercises.ch6",
    "fa_lab.exercises.ch8",
    "fa_lab.exercises.ch8_kernels",
    "fa_lab.exercises.ch9",
    "fa_lab.exercises.ch9_kernels",
    "fa_lab.exercises.ch10",
    "fa_lab.exercises.ch10_kernels",
]


#: what the learner writes: PyTorch/NumPy code, a Numba CUDA kernel, or a Triton kernel
KINDS = ("python", "numba", "triton")


@dataclass
class Case:
    """One call: ``fn(*args, **kwargs)``, judged at ``dtype``'s tolerance."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    meta: dict = field(default_factory=dict)


@dataclass
class Mistake:
    """A typical wrong answer: ``fn`` has the solution's signature and makes exactly this mistake."""

    name: str
    fn: Callable
    message: str


@dataclass
class Exercise:
    name: str
    chapter: int
    title: str
    signature: str                           # what the learner writes, e.g. "softmax_rows(s) -> Tensor"
    solution: Callable
    make_cases: Callable[[int], list]        # seed -> [Case, ...]
    compare: Callable | None = None          # (got, expected, case) -> None, raises AssertionError
    hint: str = ""                           # a single hint (older form of ``hints``)
    # optional, see the module docstring
    tile: Any = None
    structure: tuple = ()
    mistakes: tuple = ()
    out_args: tuple = ()
    outputs: tuple = ()
    judge_dtype: torch.dtype | None = None
    strict_dtype: bool = True
    poison_empty: bool = True
    kind: str = "python"
    hints: tuple = ()
    model_answer: Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.model_answer is None:
            self.model_answer = self.solution
        if not self.hints and self.hint:
            self.hints = (self.hint,)

    def tile_for(self, case: Case) -> tuple:
        tile = self.tile(case) if callable(self.tile) else self.tile
        block_m, block_n = tile if tile else (None, None)
        return case.meta.get("block_m", block_m), case.meta.get("block_n", block_n)


#: every registered exercise by name (filled as the chapter modules are imported)
EXERCISES: dict[str, Exercise] = {}


def register_exercise(ex: Exercise) -> Exercise:
    if ex.name in EXERCISES:
        raise ValueError(f"exercise {ex.name!r} is registered twice")
    EXERCISES[ex.name] = ex
    return ex


#: chapters whose exercises are Triton kernels, and their modules: not loaded where Triton is not installed
TRITON_CHAPTERS = {4: ("fa_lab.exercises.ch4", "fa_lab.exercises.ch4_kernels"),
                   5: ("fa_lab.exercises.ch5", "fa_lab.exercises.ch5_kernels", "fa_lab.exercises.ch5_split"),
                   8: ("fa_lab.exercises.ch8_kernels",),
                   9: ("fa_lab.exercises.ch9_kernels",),
                   10: ("fa_lab.exercises.ch10_kernels",)}


def load() -> dict[str, Exercise]:
    """Import every chapter's module (each registers its exercises) and return the registry."""
    from fa_lab.core.world import HAS_TRITON

    triton_modules = {mod for mods in TRITON_CHAPTERS.values() for mod in mods}
    for mod in CHAPTER_MODULES:
        if HAS_TRITON or mod not in triton_modules:
            importlib.import_module(mod)
    return EXERCISES


def names(chapter: int | None = None) -> list[str]:
    """Registered exercise names (optionally one chapter's)."""
    return [n for n, ex in load().items() if chapter is None or ex.chapter == chapter]


def get(name: str) -> Exercise:
    if not isinstance(name, str):
        raise TypeError(f"an exercise name is a string such as 'ch1_causal_mask', got {type(name).__name__}")
    exercises = load()
    if name not in exercises:
        from fa_lab.core.world import HAS_TRITON, TRITON_MISSING

        chapter = name[2:name.find("_")] if name.startswith("ch") else ""
        if not HAS_TRITON and chapter.isdigit() and int(chapter) in TRITON_CHAPTERS:
            raise ValueError(f"exercise {name!r} is a Triton exercise: {TRITON_MISSING}")
        raise ValueError(f"unknown exercise {name!r}; known exercises: {', '.join(exercises)}")
    return exercises[name]


def reference(name: str):
    """The solution, a callable with the signature the exercise asks for."""
    return get(name).solution


def model_answer(name: str):
    """What a learner would write (for a kernel exercise: the function that launches the kernel)."""
    return get(name).model_answer


def hint(name: str, level: int = 1) -> str:
    """Hint number ``level`` (1 = the gentlest) of an exercise; asking past the last says so."""
    ex = get(name)
    if not ex.hints:
        return f"{name}: no hints for this exercise"
    if not isinstance(level, int) or level < 1:
        raise ValueError(f"level is 1, 2, ... up to {len(ex.hints)}, got {level!r}")
    if level > len(ex.hints):
        return f"{name} has {len(ex.hints)} hint(s); here is the last one:\n{ex.hints[-1]}"
    more = f"  (hint({name!r}, {level + 1}) says more)" if level < len(ex.hints) else ""
    return f"Hint {level}/{len(ex.hints)}: {ex.hints[level - 1]}{more}"


def describe(name: str) -> str:
    ex = get(name)
    hints = f"\n  hints: {len(ex.hints)}, opened one at a time with hint({name!r}, 1), 2, ..." if ex.hints else ""
    return f"{ex.title}\n  write: {ex.signature}{hints}"
