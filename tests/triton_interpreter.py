"""Two mends to Triton's interpreter (``TRITON_INTERPRET=1``), made by the test session only (``conftest``), so that
the kernels the GPU compiles run here unchanged; the product never patches Triton.

- **A loop bound loaded from memory** (``for s in range(lo, hi, BLOCK)`` with ``hi`` from a tensor): Triton 3.6's
  interpreter turns a scalar into a Python int with ``int(array)``, which NumPy ≥ 2.3 refuses for a 1-element
  array that is not 0-d ("only 0-dimensional arrays can be converted to Python scalars"). 3.7+ reads the element
  (``squeeze``); the mend does the same on every version.
- **16-bit products** (``tl.dot`` of bf16 operands): the interpreter keeps bf16 as its raw ``uint16`` bits and
  multiplies those integers. The mend widens bf16 to float32 first (exact: a bf16 is a float32 whose low 16 bits
  are zero), then multiplies and accumulates in float32 as the GPU's tensor cores do. fp8 and fp16 are left as
  the interpreter has them.
"""

from __future__ import annotations

import numpy as np


def mend() -> None:
    """Apply both mends (idempotent); a no-op where Triton is not installed."""
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

    interpreter._patch_lang_tensor = _patch_lang_tensor
    builder.create_dot = _create_dot
    interpreter._vlm_mended = True
