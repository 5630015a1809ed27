"""Bounds checking for Triton kernels run by the Triton interpreter (CPU).

Inside ``with bounds_checked():`` every unmasked element of every ``tl.load`` / ``tl.store`` of
an interpreted kernel must address the storage of one of that launch's tensor arguments;
otherwise the access raises (the interpreter wraps it in an ``InterpreterError`` naming the
kernel). On a GPU the same access is an illegal-address fault that surfaces at some later
launch; here it is caught at the instruction.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from triton.runtime import interpreter as interp


class OutOfBounds(AssertionError):
    pass


@contextlib.contextmanager
def bounds_checked():
    launch = {"kernel": "", "ranges": []}
    call, load, store = (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
                         interp.InterpreterBuilder.create_masked_store)

    def checked_call(self, *args, **kwargs):
        launch["kernel"] = self.fn.__name__
        launch["ranges"] = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                            for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        return call(self, *args, **kwargs)

    def check(ptrs, mask, kind):
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(addr.shape, dtype=bool)
        for base, nbytes in launch["ranges"]:
            ok |= (addr >= base) & (addr + size <= base + nbytes)
        if not ok.all():
            raise OutOfBounds(f"{kind} of {int((~ok).sum())} elements outside every tensor argument "
                              f"of {launch['kernel']}")

    def checked_load(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interp.GridExecutor.__call__ = checked_call
    interp.InterpreterBuilder.create_masked_load = checked_load
    interp.InterpreterBuilder.create_masked_store = checked_store
    try:
        yield
    finally:
        interp.GridExecutor.__call__ = call
        interp.InterpreterBuilder.create_masked_load = load
        interp.InterpreterBuilder.create_masked_store = store
