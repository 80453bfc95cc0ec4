"""Judging one case: fresh inputs, the expected outputs, and whether the learner's outputs match.

The judge is the solution run on a fresh copy of the case's inputs (upcast to
``Exercise.judge_dtype`` when the exercise asks for it: the float64 reference is then the
judge, at the tolerance of the case's dtype).  A wrong answer gets a diagnosis when one is
known: right values in the wrong type or dtype say what was expected; otherwise the known
mistakes (``Exercise.mistakes``) are tried and the one the output reproduces is named.
"""
from __future__ import annotations

import torch

from fa_lab.core.testing import tolerance
from fa_lab.exercises.feedback import check_like, compare_tensor
from fa_lab.exercises.guard import call_with_timeout, safe_text
from fa_lab.exercises.registry import Case, Exercise
from fa_lab.exercises.structure import PoisonEmpty, poison_

# --------------------------------------------------------------------------- inputs and outputs

def clone(x):
    """Fresh copies of tensor arguments, so the learner's code cannot alter the solution's inputs."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(clone(i) for i in x)
    return x


def upcast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.detach().to(dtype) if x.is_floating_point() else x.detach().clone()
    if isinstance(x, dict):
        return {k: upcast(v, dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(upcast(i, dtype) for i in x)
    return x


def prepare_args(ex: Exercise, case: Case):
    """Fresh ``(args, kwargs)`` for one call, with the output arguments (kernel style) poisoned."""
    args, kwargs = clone(case.args), clone(case.kwargs)
    args = list(args)
    for i in ex.out_args:
        poison_(args[i])
    return tuple(args), kwargs


def outputs_of(ex: Exercise, value, args):
    """What is judged: the return value, or (kernel style) the output arguments after the call."""
    if not ex.out_args:
        return value
    outs = tuple(args[i] for i in ex.out_args)
    return outs[0] if len(outs) == 1 else outs


def output_name(ex: Exercise | None, i: int | None) -> str:
    names = ex.outputs if ex is not None else ()
    if i is None:
        return names[0] if len(names) == 1 else "result"
    return names[i] if i < len(names) else f"result[{i}]"


def expected_outputs(ex: Exercise, case: Case):
    """(judge, native): the values to compare against, and the solution's output in the case's own dtypes."""
    args, kwargs = prepare_args(ex, case)
    native = outputs_of(ex, ex.solution(*args, **kwargs), args)
    if ex.judge_dtype is None:
        return native, native
    args, kwargs = upcast(prepare_args(ex, case), ex.judge_dtype)
    return outputs_of(ex, ex.solution(*args, **kwargs), args), native


# --------------------------------------------------------------------------- comparing

def _compare_leaf(g, e, n, what, case: Case, ex: Exercise | None, values: bool) -> None:
    tile = ex.tile_for(case) if ex is not None else (None, None)
    strict = ex.strict_dtype if ex is not None else True
    if not values:
        if isinstance(e, torch.Tensor):
            check_like(g, e, what=what, strict_dtype=strict)
        return
    if isinstance(e, torch.Tensor):
        compare_tensor(g, e, what=what, tol_dtype=case.dtype,
                       expected_dtype=n.dtype if isinstance(n, torch.Tensor) else None,
                       strict_dtype=strict, tile=tile, meta=case.meta)
    elif isinstance(e, float) and isinstance(g, (int, float)) and not isinstance(g, bool):
        atol, rtol = tolerance(case.dtype)
        if not (g == e or abs(g - e) <= atol + rtol * abs(e)):
            raise AssertionError(f"{what}: got {safe_text(g, repr, 500)}, expected {e!r}")
    elif isinstance(g, torch.Tensor) and g.numel() == 1 and not isinstance(e, torch.Tensor):
        raise AssertionError(f"{what}: got a tensor, expected a plain Python {type(e).__name__} (use .item())")
    elif g != e:
        raise AssertionError(f"{what}: got {safe_text(g, repr, 500)}, expected {e!r}")


def compare_tree(got, expected, native, case: Case, ex: Exercise | None, values: bool = True) -> None:
    """Same structure, then each tensor within the case dtype's tolerance (dtypes from ``native``).

    ``values=False`` checks only the structure, types, shapes, devices and dtypes (before a custom compare).
    """
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            names = ", ".join(output_name(ex, i) for i in range(len(expected)))
            raise AssertionError(f"expected a tuple of {len(expected)} results ({names}), got {type(got).__name__}"
                                 + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))
        for i, (g, e) in enumerate(zip(got, expected)):
            n = native[i] if isinstance(native, (tuple, list)) else None
            _compare_leaf(g, e, n, output_name(ex, i), case, ex, values)
    else:
        _compare_leaf(got, expected, native, output_name(ex, None), case, ex, values)


def compare_outputs(got, expected, case: Case) -> None:
    """Default judge: same structure, then each tensor within the dtype's tolerance (and the same dtype)."""
    compare_tree(got, expected, expected, case, None)


def judge(ex: Exercise, got, expected, native, case: Case) -> None:
    """Raise ``AssertionError`` (a ``Mismatch`` for wrong numbers) unless ``got`` is right."""
    if ex.compare is not None:
        compare_tree(got, native, native, case, ex, values=False)  # shapes, dtypes, devices: for every exercise
        ex.compare(got, expected, case)
    else:
        compare_tree(got, expected, native, case, ex)


# --------------------------------------------------------------------------- diagnoses

def _is_numpy(x) -> bool:
    return type(x).__module__.split(".")[0] == "numpy"


def _as_expected(g, n):
    """``g`` converted to the type, dtype and device of ``n`` (the solution's output), leaf by leaf."""
    if isinstance(n, torch.Tensor):
        if isinstance(g, torch.Tensor) or _is_numpy(g) or isinstance(g, (list, tuple, int, float)):
            return torch.as_tensor(g).to(device=n.device, dtype=n.dtype)
        return g
    if isinstance(n, (tuple, list)) and isinstance(g, (tuple, list)) and len(g) == len(n):
        return type(n)(_as_expected(gi, ni) for gi, ni in zip(g, n))
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return g
    if isinstance(g, torch.Tensor) and g.numel() == 1:
        g = g.item()
    elif _is_numpy(g) and getattr(g, "size", 0) == 1:
        g = g.item()
    if isinstance(n, int) and isinstance(g, float) and g.is_integer():
        return int(g)
    return type(n)(g) if isinstance(g, (int, float)) and not isinstance(g, bool) else g


def _type_words(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a torch.Tensor of {x.dtype} on {x.device}"
    if _is_numpy(x):
        kind = type(x).__name__
        return f"a NumPy array of {x.dtype}" if kind == "ndarray" else f"a NumPy {kind}"
    kind = type(x).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def _difference(g, n, name: str) -> str:
    """What differs in one result besides its values, and the fix ('' if type, dtype and device agree)."""
    if isinstance(n, torch.Tensor) and isinstance(g, torch.Tensor):
        if g.dtype != n.dtype:
            return (f"{name} has dtype {g.dtype} where {n.dtype} is expected (return {name}.to({n.dtype}), "
                    "or compute in that dtype)")
        if g.device != n.device:
            return f"{name} is on device {g.device} where {n.device} is expected (allocate with device=q.device)"
        return ""
    if type(g) is type(n):
        return ""
    if isinstance(n, torch.Tensor):
        fix = "torch.from_numpy(...)" if _is_numpy(g) else "torch.tensor(...)"
        return f"{name} is {_type_words(g)} where {_type_words(n)} is expected (convert it with {fix})"
    fix = " (use .item())" if isinstance(g, torch.Tensor) or _is_numpy(g) else ""
    return f"{name} is {_type_words(g)} where {_type_words(n)} is expected{fix}"


def type_diagnosis(ex: Exercise, got, expected, native, case: Case) -> str:
    """When ``got`` has the right values in the wrong type, dtype or device: what was expected ('' if not)."""
    try:
        converted = _as_expected(got, native)
        if converted is got:
            return ""
        judge(ex, converted, expected, native, case)
        if isinstance(native, (tuple, list)):
            found = [_difference(g, n, output_name(ex, i)) for i, (g, n) in enumerate(zip(got, native))]
        else:
            found = [_difference(got, native, output_name(ex, None))]
    except KeyboardInterrupt:  # the user's stop button: the check is interrupted
        raise
    except BaseException:  # noqa: BLE001 — not convertible, or still wrong: no such diagnosis
        return ""
    found = [f for f in found if f]
    return f"the values are right, but {'; '.join(found)}." if found else ""


def match_mistake(ex: Exercise, got, case: Case, budget: float) -> str:
    """The known mistake the learner's output reproduces on this case, in words ('' if none)."""
    for m in ex.mistakes:
        try:
            args, kwargs = prepare_args(ex, case)
            hooks = [PoisonEmpty()] if ex.poison_empty else []
            value = call_with_timeout(m.fn, args, kwargs, min(budget, 10.0), hooks)
            compare_tree(got, outputs_of(ex, value, args), None, case, ex)
        except KeyboardInterrupt:  # the user's stop button: the check is interrupted
            raise
        except BaseException:  # noqa: BLE001 — no match (or the mistake itself failed): try the next one
            continue
        return f"your result matches a known mistake — {m.name}: {m.message}"
    return ""
