"""Three mends to Triton's interpreter (``TRITON_INTERPRET=1``), made by the test session only (``conftest``), so that
the kernels the GPU compiles run here unchanged; the product never patches Triton.

- **A loop bound loaded from memory** (``for s in range(lo, hi, BLOCK)`` with ``hi`` from a tensor): Triton 3.6's
  interpreter turns a scalar into a Python int with ``int(array)``, which NumPy ≥ 2.3 refuses for a 1-element
  array that is not 0-d ("only 0-dimensional arrays can be converted to Python scalars"). 3.7+ reads the element
  (``squeeze``); the mend does the same on every version.
- **16-bit products** (``tl.dot`` of bf16 operands): the interpreter keeps bf16 as its raw ``uint16`` bits and
  multiplies those integers. The mend widens bf16 to float32 first (exact: a bf16 is a float32 whose low 16 bits
  are zero), then multiplies and accumulates in float32 as the GPU's tensor cores do. fp8 and fp16 are left as
  the interpreter has them.
- **Speed, not semantics**: every call of a ``@triton.jit`` helper from inside a kernel (``_row_splits``) patches
  ``triton.language`` all over again, though the launch patched it already and restores it at its end: an
  ``inspect.getmembers`` of the language per call, per program, a quarter of an interpreted decode step. The mend
  lets such a call find the launch's patch in place when the modules it sees (``tl``, ``tl.core``) were patched
  during the launch; a helper that sees another (Triton's own ``tl.zeros`` sees ``tl.core``) patches it once.
"""

from __future__ import annotations

import inspect

import numpy as np


def mend() -> None:
    """Apply the mends (idempotent); a no-op where Triton is not installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_vlm_mended", False):
        return
    import triton.language as tl

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope) -> None:  # noqa: ANN001 - Triton's own signature
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widened(handle):  # noqa: ANN001, ANN202
        if handle.dtype == tl.bfloat16:
            data = (np.asarray(handle.data).astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    patch_lang = interpreter._patch_lang
    launch: dict = {"on": False, "langs": set()}  # a launch under way, and the language modules patched during it

    class _InPlace:
        def restore(self) -> None:
            """Nothing: the launch's own patch restores the language at its end."""

    def _patch_lang(fn):  # noqa: ANN001, ANN202 - Triton's own signature
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launch["on"] and langs <= launch["langs"]:  # a helper's call, the language it sees patched already
            return _InPlace()
        scope = patch_lang(fn)
        if not launch["on"]:  # the launch's own patch (a helper's, as Triton has it, is never restored)
            launch["on"] = True
            restore = scope.restore

            def restore_and_end() -> None:
                launch["on"] = False
                launch["langs"].clear()
                restore()

            scope.restore = restore_and_end
        launch["langs"] |= langs
        return scope

    interpreter._patch_lang_tensor = _patch_lang_tensor
    interpreter._patch_lang = _patch_lang
    builder.create_dot = _create_dot
    interpreter._vlm_mended = True
